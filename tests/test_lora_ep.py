"""A LoRA policy with expert parallelism (`actor.ep = 2`, 2 gloo ranks) against the same LoRA run with FSDP
alone: the same losses, the same adapters.

The model is the tiny Qwen3-MoE of `tests/test_expert_parallel_actor.py`; its fused experts are not
linear layers, so LoRA leaves them frozen, sharded over the EP ranks, while the adapters of the attention
and the shared projections train. Gradients reach the adapters of the first layer through the second
layer's all-to-all dispatch, so a wrong backward through EP shows in the adapters.
"""

from pathlib import Path

import pytest

from tests.test_actor_support import assert_same_steps, make_run, put_groups, sample_groups, torchrun
from tests.test_expert_parallel_actor import OVERRIDES, moe_dir  # noqa: F401 - the tiny MoE fixture

LORA = ["actor.lora.rank=4", "actor.lora.alpha=8.0", "actor.lr=0.01", "model.dtype='float32'"]


def _run(root: Path, name: str, model: Path, groups, extra: list[str]):
    cfg, run = make_run(root, name, model, [*OVERRIDES, *LORA, *extra])
    put_groups(cfg, run, groups)
    code, log = torchrun(run.path, 2, timeout=300)
    assert code == 0, log[-4000:]
    return run, log


@pytest.mark.slow
def test_lora_with_expert_parallelism_matches_fsdp(tmp_path, moe_dir) -> None:  # noqa: F811
    import torch
    from safetensors.torch import load_file

    groups = sample_groups(moe_dir, 4, 4, seed=5)
    fsdp, _ = _run(tmp_path, "fsdp", moe_dir, groups, [])
    ep, log = _run(tmp_path, "ep", moe_dir, groups, ["actor.ep=2"])
    assert "expert parallel: 2 MoE layers' experts over EP groups of 2 (FSDP over 1)" in log
    assert_same_steps(fsdp.metrics, ep.metrics, [1, 2])
    a = load_file(str(fsdp.checkpoints / "step_000002" / "policy" / "adapter_model.safetensors"))
    b = load_file(str(ep.checkpoints / "step_000002" / "policy" / "adapter_model.safetensors"))
    assert set(a) == set(b) and not any("experts" in n for n in a)
    assert any("layers.0." in n and "lora_A" in n for n in a)
    start = load_file(str(fsdp.checkpoints / "step_000001" / "policy" / "adapter_model.safetensors"))
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=1e-6, msg=name)
    assert any(not torch.equal(start[n], a[n]) for n in a if "layers.0." in n and "lora_A" in n)  # A trained
