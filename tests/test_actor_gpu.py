"""The actor pool on GPUs: NCCL for FSDP2 and for the refit, same code as on CPU (`make test-gpu`).

Two trainer ranks on GPUs 0 and 1 train two steps, refit a builtin engine on GPU 1 over NCCL and
checkpoint; one rank on GPU 0 trains the same first step. Skipped without two GPUs.
"""

import json
import os
import signal
import time

import pytest

from molt_hpc import checkpoint as ck
from molt_hpc.log import read_metrics
from tests.test_actor_refit import _call, _engine, _engine_code_distributions, _engine_distributions, _registered
from tests.test_actor_support import make_run, put_groups, sample_groups, torchrun

pytestmark = pytest.mark.gpu
OVERRIDES = [
    "actor.device='cuda'", "engines.device='cuda'", "rollout.n_samples=4", "actor.groups_per_step=2",
    "run.steps=2", "checkpoint.interval=1", "algorithm.kl_coef=0.05", "actor.micro_batch_size=3",
]  # fmt: skip


def _gpus() -> int:
    import torch

    return torch.cuda.device_count()


@pytest.mark.skipif(_gpus() < 2, reason="needs two GPUs")
def test_two_gpus_train_refit_over_nccl_and_match_one_gpu(tmp_path, tiny_model_dir) -> None:
    groups = sample_groups(tiny_model_dir, 4, 4, seed=5)
    cfg, run = make_run(tmp_path, "two", tiny_model_dir, OVERRIDES)
    engine = _engine(run.path, env={"CUDA_VISIBLE_DEVICES": "1"})  # its own GPU: NCCL needs one per rank
    try:
        deadline = time.monotonic() + 300
        while not _registered(run.path, engine.pid):
            assert engine.poll() is None and time.monotonic() < deadline, "the engine did not register"
            time.sleep(0.5)
        put_groups(cfg, run, groups)
        code, log = torchrun(run.path, 2, timeout=600)
        assert code == 0, log[-4000:]
        assert "refit v2" in log and _call(run.path, "/health")["weight_version"] == 2
        tokens, tables = _engine_distributions(run.path)
    finally:
        if engine.poll() is None:
            os.killpg(engine.pid, signal.SIGTERM)
            engine.wait(timeout=60)
    policy = ck.latest_checkpoint(run.checkpoints) / "policy"
    want = _engine_code_distributions(policy, tokens, device="cuda")
    diff = [max(abs(t[i] - float(row[i])) for i in range(row.shape[0])) for t, row in zip(tables, want, strict=True)]
    assert max(diff) < 1e-5, diff  # one GPU's kernels against another's: equal to rounding
    two = read_metrics(run.metrics, "actor")
    assert [r["step"] for r in two] == [1, 2]
    assert all(0 < r["mem_peak_allocated_gb"] <= r["mem_peak_reserved_gb"] for r in two)  # the step's GPU peaks
    assert json.loads((ck.latest_checkpoint(run.checkpoints) / "run_state.json").read_text())["world_size"] == 2

    cfg1, run1 = make_run(tmp_path, "one", tiny_model_dir, [*OVERRIDES, "run.steps=1"])
    put_groups(cfg1, run1, groups[:2])
    code, log = torchrun(run1.path, 1, timeout=600, env={"CUDA_VISIBLE_DEVICES": "0"})
    assert code == 0, log[-4000:]
    one = read_metrics(run1.metrics, "actor")
    for key in ("loss", "grad_norm", "entropy", "kl"):
        assert one[0][key] == pytest.approx(two[0][key], rel=1e-4, abs=1e-6), key
