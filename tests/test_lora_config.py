"""`[actor.lora]` in the config tree and in pre-flight: what it refuses, in one line, with exit code 2."""

import pytest

from molt_hpc.config import ConfigError, load_config
from tests.conftest import molt

TINY = "configs/tiny_cpu.toml"


def test_lora_section_parses_with_its_defaults() -> None:
    cfg = load_config(TINY, ["actor.lora.rank=8"])
    lora = cfg.actor.lora
    assert (lora.rank, lora.alpha, lora.dropout, lora.target_modules) == (8, 32.0, 0.0, None)
    assert load_config(TINY).actor.lora is None


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["engines.kind='vllm'", "actor.device='cuda'", "actor.lora.rank=600"], "above vLLM's LoRA rank limit"),
        (
            ["engines.kind='vllm'", "actor.device='cuda'", "actor.lora.engine_weights='merged'"],
            "vLLM engines compute the adapters separately",
        ),
        (["actor.lora.rank=0"], "rank"),
        (["actor.lora.dropout=1.0"], "dropout"),
        (["actor.lora.ranks=4"], "ranks"),
    ],
)
def test_combinations_that_cannot_run_are_refused(sets: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(TINY, ["actor.lora.rank=4", *sets])


def test_preflight_refuses_a_target_that_matches_nothing(tmp_path) -> None:
    proc = molt("run", TINY, "--set", f"run.root={tmp_path}", "--set", "actor.lora.target_modules=['q_proj', 'qkv']")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "'qkv' matches no module" in lines[0] and "q_proj" in lines[0], proc.stderr
    assert not (tmp_path / "tiny-cpu").exists()  # refused before the run directory was made


def test_preflight_refuses_a_layer_lora_cannot_adapt(tmp_path) -> None:
    from molt_hpc.launch.preflight import PreflightError, preflight

    cfg = load_config(TINY, [f"run.root={tmp_path}", "actor.lora.target_modules=['input_layernorm']"])
    with pytest.raises(PreflightError, match="Qwen3RMSNorm: LoRA here adapts linear layers only"):
        preflight(cfg)
    named = load_config(TINY, [f"run.root={tmp_path}", "actor.lora.target_modules=['self_attn.q_proj', 'down_proj']"])
    preflight(named)  # names that match linear layers pass
