"""The plan's closed-form parameter counts against the meta-device build of the same config: every shape
field, every block's parameters, routed experts and router, the root group, tying, q/k norms and the fused
head, for every shipped model shape, the builtin specs, and each family with its bias and layout flags."""

import json

import pytest

from molt_hpc.config import MoltConfig
from molt_hpc.models.resolve import builtin_config
from molt_hpc.plan.arch import arch_from_config
from molt_hpc.plan.closed_form import FAMILIES, closed_form_arch
from tests.conftest import ROOT

MODELS = sorted((ROOT / "configs" / "models").glob("*/config.json"))
SMALL = {"vocab_size": 96, "hidden_size": 48, "intermediate_size": 80, "num_hidden_layers": 3,
         "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip
MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 24}
VARIANTS = {
    "llama": {**SMALL, "model_type": "llama"},
    "llama biases, untied": {**SMALL, "model_type": "llama", "attention_bias": True, "mlp_bias": True},
    "llama tied, own head width": {**SMALL, "model_type": "llama", "tie_word_embeddings": True, "head_dim": 16},
    "mistral": {**SMALL, "model_type": "mistral"},
    "qwen2": {**SMALL, "model_type": "qwen2", "tie_word_embeddings": True},
    "qwen3 with attention bias": {**SMALL, "model_type": "qwen3", "head_dim": 8, "attention_bias": True},
    "qwen3_moe dense first layer": {**SMALL, **MOE, "model_type": "qwen3_moe", "head_dim": 12, "mlp_only_layers": [0]},
    "qwen3_moe every second layer": {**SMALL, **MOE, "model_type": "qwen3_moe", "head_dim": 12,
                                     "decoder_sparse_step": 2},
    "qwen2_moe": {**SMALL, **MOE, "model_type": "qwen2_moe", "shared_expert_intermediate_size": 40},
    "qwen2_moe no qkv bias, dense layer": {**SMALL, **MOE, "model_type": "qwen2_moe", "qkv_bias": False,
                                           "shared_expert_intermediate_size": 40, "mlp_only_layers": [1]},
}  # fmt: skip


def meta_arch(data: dict, source: str):
    from transformers import CONFIG_MAPPING

    fields = {k: v for k, v in data.items() if not k.startswith("_")}
    return arch_from_config(CONFIG_MAPPING[data["model_type"]].from_dict(fields), source)


@pytest.mark.parametrize("path", MODELS, ids=lambda p: p.parent.name)
def test_every_shipped_shape_of_a_counted_family_is_counted_exactly(path) -> None:
    data = json.loads(path.read_text())
    closed = closed_form_arch(data, str(path))
    if data["model_type"] not in FAMILIES:  # DeepSeek-V3's latent attention: the meta build counts it
        assert closed is None
        return
    assert closed is not None
    assert closed == meta_arch(data, str(path))


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_each_family_and_flag_is_counted_exactly(name: str) -> None:
    data = VARIANTS[name]
    closed = closed_form_arch(data, name)
    assert closed is not None
    meta = meta_arch(data, name)
    assert closed == meta
    assert closed.params == meta.params and closed.blocks == meta.blocks  # (in the equality; said for the reader)


@pytest.mark.parametrize("builtin", ["builtin:tiny-char", "builtin:tiny-moe"])
def test_the_builtin_specs_are_counted_exactly(builtin: str) -> None:
    model = MoltConfig().model.model_copy(update={"path": builtin})
    config = builtin_config(model)
    closed = closed_form_arch(config.to_dict(), builtin)
    assert closed is not None and closed == arch_from_config(config, builtin)


def test_a_saved_tiny_moe_directory_is_counted_exactly(tiny_moe_dir) -> None:
    """A model directory's config.json as transformers saves it (Qwen3-MoE names its experts
    `num_local_experts` there), as `molt-hpc plan` reads a `model.path`."""
    path = tiny_moe_dir / "config.json"
    data = json.loads(path.read_text())
    closed = closed_form_arch(data, str(path))
    assert closed is not None and closed.experts > 0 and closed == meta_arch(data, str(path))


def test_a_field_left_to_a_family_default_goes_to_the_meta_build() -> None:
    assert closed_form_arch({**SMALL, "model_type": "qwen3"}) is None  # Qwen3's head_dim default is not hidden/heads
    no_kv = {k: v for k, v in SMALL.items() if k != "num_key_value_heads"}
    assert closed_form_arch({**no_kv, "model_type": "llama"}) is None
    assert closed_form_arch({**SMALL, "model_type": "qwen3_moe", "head_dim": 8}) is None  # no expert fields
    assert closed_form_arch({**SMALL, "model_type": "gemma2"}) is None
