"""vLLM engines on GPUs (`make test-gpu`): `vllm serve` behind our front, refit by `VllmRefitSender`.

The engine process (jobs/engine.py, `engines.kind = "vllm"`) runs on GPU 1 and the trainer side (this
test process, or the actor pool of a local run) on GPU 0: a refit over NCCL (two GPUs). With both on
GPU 0 the refit goes through CUDA IPC into our worker extension (one GPU). The model is the tiny one
with 2 heads, so its head size is 64 (FlashAttention's kernels start there). Skipped without vLLM.
"""

import json
import math
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request

import pytest

from molt_hpc.config import load_config, to_toml
from molt_hpc.log import read_metrics
from molt_hpc.rundir import create_run_dir
from tests.conftest import BIN, ROOT, gpu_count, vllm_gpu_marks
from tests.test_actor_refit import _call, _engine
from tests.test_e2e import steps_and_rising_reward

VLLM_SETS = [
    "model.path='builtin:tiny-char'", "model.tiny.num_heads=2", "model.dtype='bfloat16'",
    "engines.kind='vllm'", "engines.device='cuda'", "actor.device='cuda'", "engines.enforce_eager=true",
    "engines.gpu_memory_utilization=0.3", "refit.host='127.0.0.1'",
]  # fmt: skip
PROMPT = list(range(5, 21))


pytestmark = vllm_gpu_marks()
needs_two = pytest.mark.skipif(gpu_count() < 2, reason="needs two GPUs (NCCL between the trainer's and vLLM's)")


def _sample(run_dir) -> dict:
    """A seeded sample of 6 tokens after PROMPT with each token's log-prob (temperature 1)."""
    return _call(run_dir, "/inference/v1/generate", {
        "token_ids": PROMPT,
        "sampling_params": {"temperature": 1.0, "max_tokens": 6, "seed": 3, "ignore_eos": True},
    })  # fmt: skip


def _logprobs(answer: dict) -> list[float]:
    return [e["logprob"] for e in answer["choices"][0]["logprobs"]["content"]]


def _wait_registered(run_dir, proc, timeout: float = 900) -> dict:
    path = run_dir / "rendezvous" / "engine-0.json"
    deadline = time.monotonic() + timeout
    while True:
        if path.exists():
            rec = json.loads(path.read_text())
            if rec["pid"] == proc.pid:
                return rec
        assert proc.poll() is None, f"the vLLM engine exited with {proc.returncode}"
        assert time.monotonic() < deadline, "the vLLM engine did not register"
        time.sleep(1.0)


@needs_two
def test_refit_changes_what_vllm_serves(tmp_path) -> None:
    """Zeroing the (tied) embeddings makes every next-token log-prob exactly -ln V; restoring them gives back
    the log-probs served before any refit; each answer carries the version of the refit before it."""
    zero_and_restore(tmp_path, engine_gpu="1", transport="nccl")


def test_refit_through_cuda_ipc_into_vllm_on_the_trainers_gpu(tmp_path) -> None:
    """The same with vLLM on the sender's GPU: NCCL cannot join them, the refit goes through CUDA IPC."""
    zero_and_restore(tmp_path, engine_gpu="0", transport="ipc")


def zero_and_restore(tmp_path, engine_gpu: str, transport: str) -> None:
    import torch

    from molt_hpc.engine.client import parse_generate_response
    from molt_hpc.models import load_causal_lm, resolve_model
    from molt_hpc.refit.buckets import TensorMeta
    from molt_hpc.refit.vllm_sender import VllmRefitSender

    cfg = load_config(None, [f"run.root='{tmp_path}'", "run.name='v'", *VLLM_SETS])
    run = create_run_dir(tmp_path, "v", to_toml(cfg))
    engine = _engine(run.path, env={"CUDA_VISIBLE_DEVICES": engine_gpu})
    sender = None
    try:
        rec = _wait_registered(run.path, engine)
        before = _sample(run.path)
        assert before["weight_version"] == 0
        with pytest.raises(urllib.error.HTTPError) as err:  # the front checks the run's token
            urllib.request.urlopen(rec["url"] + "/health", timeout=10)
        assert err.value.code == 401

        model = load_causal_lm(resolve_model(cfg.model, run.models), dtype="float32", device="cuda:0")
        vocab = model.config.vocab_size
        metas = [TensorMeta(n, "bfloat16", tuple(p.shape)) for n, p in model.named_parameters()]
        sender = VllmRefitSender(cfg.refit, run.token(), device="cuda:0")
        sender.connect([rec["url"]])
        assert sender.transports == {rec["url"]: transport}
        saved = model.model.embed_tokens.weight.detach().clone()
        with torch.no_grad():
            model.model.embed_tokens.weight.zero_()
        sender.push(list(model.named_parameters()), version=1, metas=metas)
        zeroed = _sample(run.path)
        # per-token versions as the protocol's readers take them (absent: every token has weight_version)
        assert zeroed["weight_version"] == 1 and set(parse_generate_response(zeroed).weight_versions) == {1}
        assert max(abs(lp + math.log(vocab)) for lp in _logprobs(zeroed)) < 1e-4, _logprobs(zeroed)

        with torch.no_grad():
            model.model.embed_tokens.weight.copy_(saved)
        sender.push(list(model.named_parameters()), version=2, metas=metas)
        after = _sample(run.path)
        assert after["weight_version"] == 2
        assert after["choices"][0]["token_ids"] == before["choices"][0]["token_ids"]
        assert max(abs(a - b) for a, b in zip(_logprobs(after), _logprobs(before), strict=True)) < 1e-3
        assert _call(run.path, "/health")["weight_version"] == 2
    finally:
        if sender is not None:
            sender.close()
        if engine.poll() is None:
            os.killpg(engine.pid, signal.SIGTERM)
            engine.wait(timeout=120)
    assert not (run.path / "rendezvous" / "engine-0.json").exists()  # a clean stop unregisters


@needs_two
def test_local_run_with_vllm_engine_learns(tmp_path) -> None:
    """`molt-hpc run` with `engines.kind = "vllm"`: the trainer on GPU 0 refits vLLM on GPU 1 every step, the
    reward rises (the CPU end-to-end test's recipe) and the engine ends on the trainer's last version."""
    steps = 120
    sets = [
        *VLLM_SETS,
        f"run.root={tmp_path}",
        f"run.steps={steps}",
        "actor.lr=1e-3",
        "checkpoint.interval=50",
        "logging.progress=lines",
    ]
    cmd = [str(BIN / "molt-hpc"), "run", "configs/tiny_cpu.toml"] + [a for s in sets for a in ("--set", s)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    run_dir = tmp_path / "tiny-cpu"
    actor = steps_and_rising_reward(run_dir, steps)
    assert sum(1 for r in actor if r.get("refit_s") is not None) == steps
    finished = read_metrics(run_dir / "metrics.jsonl", source="launcher")[-1]
    assert finished["engine_versions"] == {"engine-0": steps}
    assert "vLLM engines" in (run_dir / "logs" / "actor.log").read_text(errors="replace")
