"""One GPU for both pools (`make test-gpu`; needs one GPU, runs on more, always on GPU 0 alone).

NCCL refuses two ranks on one GPU, so the refit between a trainer and an engine on the same GPU goes
through CUDA IPC (`refit/ipc.py`). The tests: an engine on the GPU takes a push from a sender on the
same GPU exactly; its memory stays inside `engines.gpu_memory_utilization`; the trainer (torchrun)
and an engine share the GPU, train two steps and the engine serves the checkpointed weights; and a
short `molt-hpc run` trains with both pools on the GPU and ends on the trainer's version.
"""

import os
import signal
import subprocess
import time

import aiohttp
import pytest
import torch

from molt_hpc import checkpoint as ck
from molt_hpc.config.infra import RefitConfig
from molt_hpc.log import read_metrics
from molt_hpc.models import load_causal_lm
from molt_hpc.refit import RefitSender
from tests.conftest import BIN, ROOT
from tests.test_actor_refit import _engine, _engine_code_distributions, _engine_distributions, _registered, _until
from tests.test_actor_support import make_run as make_actor_run
from tests.test_actor_support import put_groups, sample_groups, torchrun
from tests.test_engine_gpu import gpu_logprobs
from tests.test_engine_pool import engine_logprobs, max_diff, perturbed
from tests.test_engine_procs import arun, make_run, spawn, wait_registered

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]
GPU0 = {"CUDA_VISIBLE_DEVICES": "0"}


def on_gpu0(script: str) -> subprocess.CompletedProcess:
    """`script` in a fresh Python process that sees GPU 0 only."""
    env = {**os.environ, **GPU0}
    return subprocess.run([str(BIN / "python"), "-c", script], capture_output=True, text=True, env=env)


def test_refit_through_cuda_ipc_to_an_engine_on_the_senders_gpu(tmp_path, tiny_model_dir) -> None:
    run = make_run(tmp_path, "ipc", tiny_model_dir, "engines.device='cuda'", "refit.host='127.0.0.1'")
    engine = wait_registered(run, spawn(run, "engine", 0, env=GPU0), "engine-0", timeout=300)
    token = run.token()
    try:
        ref, new = load_causal_lm(tiny_model_dir, device="cuda"), perturbed(tiny_model_dir, seed=1).to("cuda")
        sender = RefitSender(run.path, RefitConfig(bucket_mb=1, host="127.0.0.1"), token, device="cuda:0")
        sender.connect([engine.url])
        assert sender.transports == {engine.url: "ipc"}, "same GPU UUID: CUDA IPC, not NCCL"
        stats = sender.push(new.named_parameters(), version=3)

        async def served():
            async with aiohttp.ClientSession() as s:
                return await engine_logprobs(s, engine.url, token)

        got, version = arun(served())
        assert version == 3 and stats.buckets >= 2
        assert max_diff(got, gpu_logprobs(new)) < 1e-5, "the engine's logits are the sender's"
        assert max_diff(got, gpu_logprobs(ref)) > 1e-3, "the push changed the engine's outputs"
        sender.push(ref.named_parameters(), version=4)  # the same slots again, no new handles
        got, version = arun(served())
        assert version == 4 and max_diff(got, gpu_logprobs(ref)) < 1e-5
        assert engine.log.read_text().count("mapped the trainer's 2 refit slots") == 1, "shared once"
        assert "CUDA IPC" in engine.log.read_text()
        sender.close()
    finally:
        engine.stop()


def test_an_engine_on_the_senders_gpu_reads_its_parameters_in_place(tmp_path, tiny_model_dir) -> None:
    """`in_place` pushes (a world of one refits so): the engine maps the sender's fp32 parameters once and
    copies from them at each push, with no bucket packed; an in-place change of the parameters (an
    optimizer step) reaches it at the next push without a new share, new addresses are shared again,
    and the slot path still works after it."""
    run = make_run(tmp_path, "in-place", tiny_model_dir, "engines.device='cuda'", "refit.host='127.0.0.1'")
    engine = wait_registered(run, spawn(run, "engine", 0, env=GPU0), "engine-0", timeout=300)
    token = run.token()

    def served():
        async def one():
            async with aiohttp.ClientSession() as s:
                return await engine_logprobs(s, engine.url, token)

        return arun(one())

    try:
        ref = load_causal_lm(tiny_model_dir, device="cuda", dtype="float32")
        new = perturbed(tiny_model_dir, seed=1).to(device="cuda", dtype=torch.float32)
        sender = RefitSender(run.path, RefitConfig(bucket_mb=1, host="127.0.0.1"), token, device="cuda:0")
        sender.connect([engine.url])
        stats = sender.push(new.named_parameters(), version=3, in_place=True)
        got, version = served()
        assert version == 3 and stats.buckets == 0, "nothing packed"
        assert max_diff(got, gpu_logprobs(new)) < 1e-5, "the engine's logits are the sender's"
        with torch.no_grad():  # an optimizer step: in place, the same addresses
            for p in new.parameters():
                p.mul_(0.5)
        sender.push(new.named_parameters(), version=4, in_place=True)
        got, version = served()
        assert version == 4 and max_diff(got, gpu_logprobs(new)) < 1e-5
        log = engine.log.read_text()
        assert log.count("refits read them in place") == 1, "shared once for both pushes"
        sender.push(ref.named_parameters(), version=5, in_place=True)  # another model: other addresses
        got, version = served()
        assert version == 5 and max_diff(got, gpu_logprobs(ref)) < 1e-5
        assert engine.log.read_text().count("refits read them in place") == 2, "new addresses, shared again"
        sender.push(new.named_parameters(), version=6)  # the slots again
        got, version = served()
        assert version == 6 and max_diff(got, gpu_logprobs(new)) < 1e-5
        sender.close()
    finally:
        engine.stop()


def test_the_engine_stays_inside_its_gpu_memory_share(tmp_path, tiny_model_dir) -> None:
    """A KV cache that cannot fit `engines.gpu_memory_utilization` stops the engine with the numbers;
    one that fits leaves the rest of the GPU (its allocator is capped at the share)."""
    sets = ["engines.device='cuda'", "engines.gpu_memory_utilization=0.01", "engines.max_batch=4096"]
    run = make_run(tmp_path, "big", tiny_model_dir, *sets)
    proc = spawn(run, "engine", 0, env=GPU0)
    assert proc.proc.wait(timeout=300) != 0
    log = proc.log.read_text()
    assert "engines.gpu_memory_utilization = 0.01 allows" in log and "lower max_batch or max_model_len" in log, log

    script = (
        "import torch; from molt_hpc.engine.slots import bound_gpu_memory; "
        "bound_gpu_memory(torch.device('cuda'), 0.05); total = torch.cuda.get_device_properties(0).total_memory\n"
        "try:\n    torch.empty(int(0.06 * total), dtype=torch.uint8, device='cuda'); print('allocated')\n"
        "except torch.OutOfMemoryError:\n    print('refused')"
    )
    out = on_gpu0(script)
    assert out.stdout.strip() == "refused", out.stdout + out.stderr


def test_trainer_and_engine_share_the_gpu_and_the_engine_serves_the_checkpoint(tmp_path, tiny_model_dir) -> None:
    sets = ["actor.device='cuda'", "engines.device='cuda'", "rollout.n_samples=4", "actor.groups_per_step=2",
            "run.steps=2", "checkpoint.interval=1", "refit.host='127.0.0.1'"]  # fmt: skip
    cfg, run = make_actor_run(tmp_path, "shared", tiny_model_dir, sets)
    engine = _engine(run.path, env=GPU0)
    try:
        _until(lambda: _registered(run.path, engine.pid), timeout=300, what="the engine to register")
        put_groups(cfg, run, sample_groups(tiny_model_dir, 4, 4, seed=5))
        code, log = torchrun(run.path, 1, timeout=600, env=GPU0)
        assert code == 0, log[-4000:]
        assert "CUDA IPC" in log and "refit v2" in log
        tokens, tables = _engine_distributions(run.path)
    finally:
        if engine.poll() is None:
            os.killpg(engine.pid, signal.SIGTERM)
            engine.wait(timeout=60)
    policy = ck.latest_checkpoint(run.checkpoints) / "policy"
    want = _engine_code_distributions(policy, tokens, device="cuda")
    diff = [max(abs(t[i] - float(row[i])) for i in range(row.shape[0])) for t, row in zip(tables, want, strict=True)]
    assert max(diff) < 1e-5, diff
    assert [r["step"] for r in read_metrics(run.metrics, "actor")] == [1, 2]


def test_local_run_on_one_gpu_trains_and_ends_on_the_trainers_version(tmp_path) -> None:
    """`molt-hpc run` with both pools on GPU 0: every step refits through CUDA IPC, the engine ends on the
    last version, and metrics.jsonl has each step's rollout wait, train and refit seconds."""
    steps = 20
    sets = ["actor.device='cuda'", "engines.device='cuda'", f"run.root='{tmp_path}'", f"run.steps={steps}",
            "logging.progress='lines'", "refit.host='127.0.0.1'"]  # fmt: skip
    cmd = [str(BIN / "molt-hpc"), "run", "configs/tiny_cpu.toml"] + [a for s in sets for a in ("--set", s)]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, **GPU0})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    run_dir = tmp_path / "tiny-cpu"
    actor = read_metrics(run_dir / "metrics.jsonl", source="actor")
    assert [r["step"] for r in actor] == list(range(1, steps + 1))
    assert all(r["refit_s"] is not None and r["wait_s"] >= 0 and r["step_s"] > 0 for r in actor)
    finished = read_metrics(run_dir / "metrics.jsonl", source="launcher")[-1]
    assert finished["engine_versions"] == {"engine-0": steps}
    log = (run_dir / "logs" / "actor.log").read_text(errors="replace")
    assert "CUDA IPC" in log and "Duplicate GPU" not in log
    assert time.monotonic() - t0 < 600


def test_gpu_uuid_is_what_processes_compare() -> None:
    """The same physical GPU has the same UUID in another process, whatever index it has there."""
    from molt_hpc.refit.handles import device_uuid

    here = device_uuid(torch.device("cuda", 0))
    script = "import torch; from molt_hpc.refit.handles import device_uuid; print(device_uuid(torch.device('cuda')))"
    out = on_gpu0(script)
    assert out.stdout.strip() == here, out.stderr
