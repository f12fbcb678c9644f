"""The plan of a LoRA policy: frozen base in the model dtype, fp32 adapters, and LoRA among the fixes."""

from molt_hpc.config import MoltConfig, load_config
from molt_hpc.config.model import ModelConfig
from molt_hpc.plan import plan_config
from molt_hpc.plan.arch import arch_of
from molt_hpc.plan.shape import shape_of
from molt_hpc.plan.trainer import trainer_memory
from tests.conftest import ROOT

CONFIG = ROOT / "configs" / "8b_lora_onegpu.toml"


def _llama8b_adapters(rank: int) -> int:
    """Llama-3.1-8B's adapters on q, k, v, o, gate, up, down, from its published shape (32 layers, hidden
    4096, 32 heads of 128, 8 KV heads, MLP 14336): r · (in + out) per layer, counted by hand."""
    h, q, kv, mlp = 4096, 32 * 128, 8 * 128, 14336
    per_layer = (h + q) + 2 * (h + kv) + (q + h) + 2 * (h + mlp) + (mlp + h)
    return 32 * rank * per_layer


def test_lora_state_is_the_frozen_base_and_fp32_adapters() -> None:
    cfg = load_config(CONFIG, ["algorithm.kl_coef=0.01"])
    arch = arch_of(ModelConfig(path="/nowhere", architecture=str(ROOT / "configs/models/llama-3.1-8b")))
    s = shape_of(cfg, 1, "cuda", arch)
    p = _llama8b_adapters(64)
    assert s.lora_params == p == 167_772_160
    mem = trainer_memory(arch, s)
    assert mem.state == {"parameters": 2 * arch.params + 4 * p, "gradients": 4 * p, "optimizer": 8 * p}
    assert "reference" not in mem.state  # the reference is the policy with its adapters off
    full = trainer_memory(arch, shape_of(_full(cfg), 1, "cuda", arch))
    assert full.state["parameters"] == 4 * arch.params and full.state["reference"] == 2 * arch.params
    backward = {ph.name: ph for ph in mem.phases}["backward: last decoder block"]
    assert backward.parts["LM head gradient"] == 0.0 and "down projection weight gradient" not in backward.parts


def _full(cfg: MoltConfig) -> MoltConfig:
    data = cfg.model_dump(exclude_none=True)
    del data["actor"]["lora"]
    return MoltConfig.model_validate(data)


def test_shipped_lora_config_fits_one_gpu_and_sends_only_adapters() -> None:
    plan, _ = plan_config(load_config(CONFIG), local=True, gpus=1)
    assert plan.fits and plan.placement.shared_gpu
    assert plan.refit.bytes == 4 * _llama8b_adapters(64)


def test_a_full_fine_tune_that_does_not_fit_is_offered_lora_at_a_rank_that_fits() -> None:
    full = _full(load_config(CONFIG))
    plan, suggestions = plan_config(full, local=True, gpus=1)
    assert not plan.fits  # 16 bytes per parameter of 8B alone are 120 GiB, beside the engine's share
    lora = [s for s in suggestions if any(c.startswith("actor.lora.rank=") for c in s.changes)]
    assert lora and lora[0].fits and lora[0].changes == ["actor.lora.rank=128"]  # the largest rank tried
    again, _ = plan_config(load_config(CONFIG, ["actor.lora.rank=128"]), local=True, gpus=1)
    assert again.fits


def test_separate_engine_adapters_cost_engine_memory_not_a_merge_or_a_host_copy() -> None:
    merged, _ = plan_config(load_config(CONFIG), local=True, gpus=1)
    separate, _ = plan_config(load_config(CONFIG, ["actor.lora.engine_weights='separate'"]), local=True, gpus=1)
    adapters = 4 * _llama8b_adapters(64)
    assert separate.engines.weights == merged.engines.weights + adapters  # the engine's fp32 LoRA layers
    assert merged.refit.merge_s > 0 and separate.refit.merge_s == 0.0
    assert separate.refit.bytes == merged.refit.bytes == adapters
    assert "engine: base of the adapted weights" in merged.host
    assert "engine: base of the adapted weights" not in separate.host
