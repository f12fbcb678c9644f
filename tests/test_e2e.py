"""The whole RL loop on one machine through `molt-hpc run`: it learns and survives an env that hangs (its
interruption, kill and resume: `tests/test_e2e_resume.py`, a file of its own so that the two runs can go to
different test workers).

Real processes throughout: the launcher, torchrun with the FSDP2 trainer, the engine pool (engine,
router, orchestrator), the replay buffer on disk. Expected values come from the run's own records
(metrics.jsonl, the buffer ledger, checkpoints), never from captured output.
"""

import json
import math
import statistics
import subprocess
import time
from pathlib import Path

import pytest

from molt_hpc.agents.env_hosts import worker_count
from molt_hpc.buffer import acked_ids, find_spool, spool_counts
from molt_hpc.log import read_metrics
from tests.conftest import BIN, ROOT

pytestmark = pytest.mark.slow


def launch(run_root: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [str(BIN / "molt-hpc"), "run", *args, "--set", f"run.root={run_root}", "--set", "logging.progress=lines"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def steps_and_rising_reward(run_dir: Path, steps: int) -> list[dict]:
    """The actor's records of a finished tiny run, checked: every step once, and the reward risen."""
    actor = read_metrics(run_dir / "metrics.jsonl", source="actor")
    assert [r["step"] for r in actor] == list(range(1, steps + 1))
    rewards = [r["reward"] for r in actor]
    q = steps // 4
    first, last = sum(rewards[:q]) / q, sum(rewards[-q:]) / q
    # An untrained policy scores ~0.03 and a prompt-ignoring one at most 0.22 on this data; a rise of
    # 0.1 in the mean over a quarter of the steps is far outside the step-to-step noise of an unchanged policy.
    assert last > first + 0.1, f"reward did not rise: first quarter {first:.3f}, last quarter {last:.3f}"
    return actor


def quarters(values: list[float]) -> tuple[float, float, float]:
    """(first-quarter mean, last-quarter mean, standard error of their difference from the scatter inside
    each quarter: a rising trend inflates it, so a rise measured in it is, if anything, understated)."""
    q = len(values) // 4
    first, last = values[:q], values[-q:]
    return (
        statistics.fmean(first),
        statistics.fmean(last),
        math.sqrt((statistics.variance(first) + statistics.variance(last)) / q),
    )


def wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        steps = [r["step"] for r in read_metrics(run_dir / "metrics.jsonl", source="actor")]
        if steps and max(steps) >= step:
            return
        assert proc.poll() is None, f"run ended early:\n{proc.stdout.read()}"
        time.sleep(0.5)
    raise AssertionError(f"no step {step} within {timeout} s")


def ledger(run_dir: Path) -> tuple[set[str], list[str], dict]:
    """(ids put, ids acked in order, counts per state) from the buffer's own files."""
    root = find_spool(run_dir)
    put = {p.name for d in (root / "producers").iterdir() for p in d.iterdir()}
    return put, acked_ids(root), spool_counts(root)


STEPS = 120  # the demo's 400 steps at half this learning rate reach 0.57; this is the lean version


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> tuple[Path, str]:
    """One run of the tiny config that two tests read: its env hangs now and then (FREEZING_ENV), which the
    run must survive and still learn through, and everything else about a finished run is checked on it."""
    root = tmp_path_factory.mktemp("tiny")
    env = root / "sometimes_freezes.py"
    env.write_text(FREEZING_ENV)
    proc = launch(
        root, "configs/tiny_cpu.toml",
        "--set", f"run.steps={STEPS}", "--set", "checkpoint.interval=50", "--set", "actor.lr=1e-3",
        "--set", f"rollout.agent={json.dumps(str(env))}", "--set", "rollout.env_timeout_s=2",
        "--set", "rollout.stall_report_s=5",
    )  # fmt: skip
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    return root / "tiny-cpu", out


def test_tiny_run_learns(tiny_run: tuple[Path, str]) -> None:
    run_dir, out = tiny_run
    steps = STEPS
    actor = steps_and_rising_reward(run_dir, steps)
    # Every step refits; the engines must serve exactly the trainer's last version.
    launcher = read_metrics(run_dir / "metrics.jsonl", source="launcher")
    finished = launcher[-1]
    # Where it ran, for the speed model beside the run (`status`): this machine, no GPU (the tests' CPU run).
    assert [{k: r[k] for k in ("mode", "gpus")} for r in launcher if r.get("event") == "placement"] == [
        {"mode": "local", "gpus": 0}
    ]
    refits = sum(1 for r in actor if r.get("refit_s") is not None)
    assert refits == steps
    assert finished["engine_versions"] == {"engine-0": actor[-1]["version"]} == {"engine-0": steps}
    # The final checkpoint is a plain HF model directory.
    from transformers import AutoModelForCausalLM

    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    model = AutoModelForCausalLM.from_pretrained(run_dir / "checkpoints" / latest / "policy", local_files_only=True)
    assert model.config.vocab_size == 104
    put, acked, _ = ledger(run_dir)
    assert len(acked) == len(set(acked)) == steps * 8
    assert set(acked) <= put
    assert "reward: first quarter" in out and "plot: " in out
    # Every process ended by its own ordered shutdown: trainer ranks (torchrun's code is theirs), the
    # pool's engine, router and orchestrator, and the pool itself.
    assert "stopped: actor pool exit 0, engine pool exit 0" in out  # reverse start order
    pool_log = (run_dir / "logs" / "pool.log").read_text()
    assert "pool stopped: orchestrator exit 0, router exit 0, engine 0 exit 0" in pool_log
    assert (run_dir / "plots" / "metrics.png").stat().st_size > 10_000


FREEZING_ENV = """
import itertools
import re

from molt_hpc.agents import Env, Result
from molt_hpc.agents.grading import reverse_reward

STEPS = itertools.count(1)  # this worker's steps: module state lives in each env worker

class SometimesFreezes(Env):
    # The tiny reverse task, except that every 500th step of a worker runs a catastrophically
    # backtracking regular expression (2^40 steps) that holds the GIL for hours.
    def step(self, state):
        if next(STEPS) % 500 == 0:
            re.match(r"(a+)+$", "a" * 40 + "b")
        return Result(reward=reverse_reward(state.action_text, str(state.label)))
"""


def test_an_env_that_freezes_cannot_stop_the_run(tiny_run: tuple[Path, str]) -> None:
    """With the default env workers, steps that hold the GIL forever cost their own samples: the
    orchestrator goes on, every hung step is killed after env_timeout_s, and the policy still learns."""
    run_dir, _ = tiny_run
    steps = STEPS
    actor = read_metrics(run_dir / "metrics.jsonl", source="actor")
    assert [r["step"] for r in actor] == list(range(1, steps + 1))
    # Hung steps cost samples and timing decides which, so how far a run gets varies from run to run (80
    # steps: 0.023 -> 0.113 in one, a rise of 16 standard errors); "still learns" is a rise far outside the noise.
    first, last, se = quarters([r["reward"] for r in actor])
    assert last - first > 5 * se, f"reward did not rise: first quarter {first:.3f}, last {last:.3f} (se {se:.3f})"
    records = read_metrics(run_dir / "metrics.jsonl", source="rollout")
    timeouts = sum(r.get("env_errors_timeout", 0) for r in records)
    # Each worker hangs on its 500th step and its replacement counts afresh: of the 120 × 64 trained
    # samples' steps (and more), at most 2 × 499 fall to the last two workers, so at least 8 hang.
    assert timeouts >= 8
    assert records[-1]["env_workers"] == worker_count("auto") and records[-1]["env_workers_replaced_total"] >= timeouts
    log = (run_dir / "logs" / "rollout.log").read_text()
    assert log.count("killed: Env.step took longer than 2 s") >= timeouts
    assert "Timeout (" not in log  # the stall report (5 s) never fired: the orchestrator's loop never stopped
    assert "orchestrator exit 0" in (run_dir / "logs" / "pool.log").read_text()
