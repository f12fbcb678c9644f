"""`builtin:tiny-moe`: a Qwen3-MoE of a few M parameters, deterministic, per-expert names on disk."""

import hashlib
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from molt_hpc.config import ConfigError, MoltConfig, load_config
from molt_hpc.models import build_tiny_moe, load_causal_lm, load_tokenizer, resolve_model
from tests.conftest import molt


def test_shape_is_the_promised_one(tiny_moe_dir: Path) -> None:
    model = load_causal_lm(tiny_moe_dir)
    c = model.config
    assert (c.model_type, c.num_experts, c.num_experts_per_tok, c.head_dim) == ("qwen3_moe", 8, 2, 64)
    assert c.vocab_size == len(load_tokenizer(tiny_moe_dir))
    n = sum(p.numel() for p in model.parameters())
    assert 1_000_000 < n < 10_000_000
    routers = [m for m in model.modules() if type(m).__name__ == "Qwen3MoeTopKRouter"]
    assert len(routers) == c.num_hidden_layers
    assert all(r.weight.abs().sum() > 0 for r in routers)  # initialised, not the zeros of __init__


def test_checkpoint_has_per_expert_names_and_reloads_equal(tiny_moe_dir: Path, tmp_path: Path) -> None:
    with safe_open(str(tiny_moe_dir / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {f"model.layers.0.mlp.experts.{e}.gate_proj.weight" for e in range(8)} <= names
    assert "model.layers.1.mlp.gate.weight" in names
    model = load_causal_lm(tiny_moe_dir)
    ids = torch.randint(0, model.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(ids).logits
    model.save_pretrained(tmp_path / "again", safe_serialization=True)
    with torch.no_grad():
        after = load_causal_lm(tmp_path / "again")(ids).logits
    assert torch.equal(before, after)


def test_build_is_deterministic_and_seeded(tmp_path: Path) -> None:
    spec = MoltConfig().model.tiny_moe.model_copy(update={"num_layers": 1})

    def digest(path: Path) -> str:
        return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()

    a = digest(build_tiny_moe(tmp_path / "a", spec))
    b = digest(build_tiny_moe(tmp_path / "b", spec))
    c = digest(build_tiny_moe(tmp_path / "c", spec.model_copy(update={"init_seed": 1})))
    assert a == b != c


def test_resolve_builds_once(tmp_path: Path) -> None:
    cfg = load_config(None, ["model.path=builtin:tiny-moe", "model.tiny_moe.num_layers=1"]).model
    first = resolve_model(cfg, tmp_path)
    assert resolve_model(cfg, tmp_path) == first
    assert first.name.startswith("tiny-moe-") and [p.name for p in tmp_path.iterdir()] == [first.name]
    assert load_causal_lm(first).config.num_hidden_layers == 1


def test_dense_layers_and_cli(tmp_path: Path) -> None:
    result = molt("model", "build-tiny", "--moe", str(tmp_path / "m"), "--set", "model.tiny_moe.dense_layers=[1]",
                  "--set", "model.tiny_moe.num_layers=3")  # fmt: skip
    assert result.returncode == 0, result.stderr
    model = load_causal_lm(tmp_path / "m")
    kinds = [type(layer.mlp).__name__ for layer in model.model.layers]
    assert kinds == ["Qwen3MoeSparseMoeBlock", "Qwen3MoeMLP", "Qwen3MoeSparseMoeBlock"]


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["model.tiny_moe.top_k=9"], "model.tiny_moe.top_k (9) exceeds model.tiny_moe.num_experts (8)"),
        (["model.tiny_moe.num_kv_heads=3"], "must divide model.tiny_moe.num_heads"),
        (["model.tiny_moe.dense_layers=[0, 1]"], "leave at least one MoE block"),
        (["model.tiny_moe.head_dim=32"], "model.tiny_moe.head_dim"),
    ],
)
def test_bad_shapes_are_config_errors(overrides: list[str], expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert expected in str(info.value)
