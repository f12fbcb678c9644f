"""Refit end to end: a real engine process (`jobs/engine.py`) serves the trainer's weights.

The trainer (torchrun, 1 gloo rank) refits at start, after each step and again when the engine,
killed with SIGKILL, is restarted (a new registration: the refit group is re-formed). After each refit the engine's
next-token distribution equals the trainer's own forward of the checkpointed weights exactly.
"""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from molt_hpc import checkpoint as ck
from molt_hpc.log import read_metrics
from tests.conftest import ROOT
from tests.test_actor_support import make_run, put_groups, sample_groups, torchrun

PROMPT = [2, 34, 32, 18, 31, 100, 57, 18]


def _engine(run_dir: Path, env: dict | None = None) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    log = open(run_dir / "logs" / f"engine-{time.monotonic_ns()}.log", "w")  # noqa: SIM115 - closed by the OS at exit
    cmd = [sys.executable, str(ROOT / "jobs" / "engine.py"), str(run_dir), "--role", "engine", "--index", "0"]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _call(run_dir: Path, path: str, body: dict | None = None) -> dict:
    reg = json.loads((run_dir / "rendezvous" / "engine-0.json").read_text())
    token = (run_dir / "rendezvous" / "token").read_text().strip()
    req = urllib.request.Request(
        reg["url"] + path,
        data=None if body is None else json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


def _until(cond, timeout: float = 120.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _registered(run_dir: Path, pid: int) -> bool:
    try:
        return json.loads((run_dir / "rendezvous" / "engine-0.json").read_text())["pid"] == pid
    except (FileNotFoundError, json.JSONDecodeError):  # not written yet, or being replaced
        return False


def _engine_distributions(run_dir: Path) -> tuple[list[int], list[dict[int, float]]]:
    """Tokens the engine generates after PROMPT and the full log-prob table of each step."""
    out = _call(run_dir, "/inference/v1/generate", {
        "token_ids": PROMPT,
        "sampling_params": {"temperature": 1.0, "max_tokens": 3, "logprobs": -1, "seed": 1, "ignore_eos": True},
    })["choices"][0]  # fmt: skip
    tables = [{e["token_id"]: e["logprob"] for e in step["top_logprobs"]} for step in out["logprobs"]["content"]]
    return out["token_ids"], tables


def _trainer_distributions(policy_dir: Path, tokens: list[int]):
    """The trainer's forward (position ids, no mask) of PROMPT + tokens: log-softmax at each step."""
    import torch

    from molt_hpc.models import load_causal_lm

    model = load_causal_lm(policy_dir)
    ids = torch.tensor([PROMPT + tokens])
    with torch.no_grad():
        logits = model(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None]).logits[0].float()
    return logits.log_softmax(-1)[len(PROMPT) - 1 : len(PROMPT) - 1 + len(tokens)]


def _engine_code_distributions(policy_dir: Path, tokens: list[int], device: str = "cpu"):
    """The engine's own forwards (prefill, then cached decode steps) run here on the checkpointed weights."""
    import torch

    from molt_hpc.engine.batch import ModelRunner
    from molt_hpc.engine.sampling import processed_logprobs
    from molt_hpc.models import load_causal_lm

    runner = ModelRunner(load_causal_lm(policy_dir, device=device), torch.device(device))
    neutral = [torch.tensor([v]) for v in (1.0, 0, 1.0, 0.0)]
    logits, cache = runner.prefill([PROMPT])
    rows = [processed_logprobs(logits, *neutral)[0]]
    for i, tok in enumerate(tokens[:-1]):
        rows.append(processed_logprobs(runner.decode(cache, [tok], [len(PROMPT) + i]), *neutral)[0])
    return torch.stack(rows).cpu()


def _max_diff(engine: list[dict[int, float]], trainer) -> list[float]:
    return [
        max(abs(table[t] - float(row[t])) for t in range(row.shape[0]))
        for table, row in zip(engine, trainer, strict=True)
    ]


@pytest.fixture(scope="module")
def refitted(tmp_path_factory, tiny_model_dir):
    import torch

    torch.set_num_threads(1)  # the engine runs with one thread too: the same kernels, the same sums
    cfg, run = make_run(tmp_path_factory.mktemp("refit"), "refit", tiny_model_dir, [
        "rollout.n_samples=4", "actor.groups_per_step=1", "run.steps=2", "checkpoint.interval=1",
        "checkpoint.keep_last=3", "engines.threads=1",
    ])  # fmt: skip
    groups = sample_groups(tiny_model_dir, 2, 4, seed=11)
    engines = [_engine(run.path)]
    trainer = None
    seen = {}
    try:
        _until(lambda: _registered(run.path, engines[0].pid), what="the engine to register")
        put_groups(cfg, run, groups[:1])
        trainer = torchrun(run.path, 1, wait=False)
        _until(lambda: ck.latest_checkpoint(run.checkpoints) is not None, what="step 1")
        _until(lambda: _call(run.path, "/health")["weight_version"] == 1, what="refit v1")
        seen[1] = _engine_distributions(run.path)
        os.killpg(engines[0].pid, signal.SIGKILL)  # its registration stays behind, naming a dead engine
        engines[0].wait(timeout=60)
        time.sleep(2)  # a few polls of the trainer with the stale registration
        assert trainer.poll() is None
        engines.append(_engine(run.path))  # restarted: it comes back with the base weights
        _until(lambda: _registered(run.path, engines[1].pid), what="the new engine to register")
        _until(lambda: _call(run.path, "/health")["weight_version"] == 1, what="the new engine's refit")
        seen["restarted"] = _engine_distributions(run.path)
        put_groups(cfg, run, groups[1:])
        assert trainer.wait(timeout=120) == 0
        seen[2] = _engine_distributions(run.path)
        assert _call(run.path, "/health")["weight_version"] == 2
    finally:
        for p in [*engines, trainer]:
            if p is not None and p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    return run, seen


def test_refit_makes_the_engine_serve_the_trainers_weights_exactly(refitted, tiny_model_dir) -> None:
    run, seen = refitted
    for key, step in ((1, 1), ("restarted", 1), (2, 2)):
        tokens, tables = seen[key]
        policy = run.checkpoints / f"step_{step:06d}" / "policy"
        # The same forwards on the trainer's weights give the engine's numbers bit for bit ...
        assert _max_diff(tables, _engine_code_distributions(policy, tokens)) == [0.0] * len(tokens), key
        # ... and the trainer's own forward (all positions at once, another kernel) agrees to rounding.
        assert max(_max_diff(tables, _trainer_distributions(policy, tokens))) < 1e-5, key
    tokens, tables = seen[2]
    assert max(_max_diff(tables, _engine_code_distributions(tiny_model_dir, tokens))) > 1e-4  # the weights moved


def test_refit_times_are_recorded(refitted) -> None:
    run, _ = refitted
    records = read_metrics(run.metrics, "actor")
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["refit_s"] is not None and r["refit_s"] > 0 for r in records)
