"""Circuit breakers: what stops a run that cannot go on, with the first failure's cause in one line.

The orchestrator's breakers run in this process against real engine and router processes; the
launcher's stall watch against a real run directory; the whole path (breaker → checkpoint → one
line, exit 1, nothing left running) through `molt-hpc run` on the tiny config.
"""

import asyncio
import json
import subprocess
import time
from pathlib import Path

import pytest

from molt_hpc.buffer import spool_counts
from molt_hpc.fault import read_failure
from molt_hpc.launch.watchdog import Watchdog
from molt_hpc.log import MetricsWriter, read_metrics
from molt_hpc.rollout.main import serve
from tests.conftest import BIN, ROOT
from tests.test_fail_fast import processes_mentioning
from tests.test_rollout_procs import base_overrides, make_run, shared_pool, spawn, wait_file

pytestmark = pytest.mark.timeout(300)

RETURNS_42 = """
from molt_hpc.agents import Env
class Answers42(Env):
    def step(self, state):
        return 42
"""


@pytest.fixture(scope="module")
def pool(tmp_path_factory, tiny_model_dir):
    return shared_pool(tmp_path_factory.mktemp("pool"), tiny_model_dir)


def test_groups_failing_in_a_row_stop_the_rollout_with_the_first_cause(pool, tmp_path) -> None:
    env = tmp_path / "answers42.py"
    env.write_text(RETURNS_42)
    overrides = [*base_overrides(Path(pool.cfg.model.path)), f"rollout.agent={json.dumps(str(env))}",
                 "rollout.max_consecutive_failures=5"]  # fmt: skip
    run, cfg = make_run(tmp_path, "run", overrides, share=pool.run)
    assert asyncio.run(asyncio.wait_for(serve(cfg, run), 120)) == 0  # it stopped on its own
    failure = read_failure(run.path)
    assert failure["source"] == "rollout" and not failure["config_error"]
    reason = failure["reason"]
    assert reason.startswith(
        "5 groups failed in a row (rollout.max_consecutive_failures = 5); first failure: group e0-i"
    )
    assert reason.endswith("env api: Env.step returned int, not a Result")
    assert (run.path / "control" / "stop").exists()  # the trainer is asked to checkpoint and stop
    assert spool_counts(run.buffer)["pending"] == 0
    [last] = read_metrics(run.metrics, source="rollout")[-1:]
    assert last["groups_failed_env_api"] >= 5 and last["env_errors_api"] >= 5
    assert last["first_failure"] in reason


def test_engines_that_never_become_healthy_stop_the_rollout(tmp_path, tiny_model_dir) -> None:
    overrides = [*base_overrides(tiny_model_dir), "engines.startup_timeout_s=2"]
    run, cfg = make_run(tmp_path, "run", overrides)
    router = spawn("engine.py", [str(run.path), "--role", "router"], run.logs / "router.log")  # no engine behind it
    try:
        wait_file(run.rendezvous / "router.json", [router])
        t0 = time.monotonic()
        assert asyncio.run(asyncio.wait_for(serve(cfg, run), 60)) == 0
        waited = time.monotonic() - t0
    finally:
        router.stop()
    reason = read_failure(run.path)["reason"]
    assert (
        reason
        == "no engine became healthy within 2 s (engines.startup_timeout_s); no engine wrote a log (see logs/pool.log)"
    )
    assert 2 <= waited < 30


def test_no_training_step_for_the_stall_timeout_stops_the_run(tmp_path) -> None:
    from molt_hpc.config import load_config

    cfg = load_config(None, ["run.stall_timeout_s=1.5"])
    (tmp_path / "control").mkdir()
    old = MetricsWriter(tmp_path / "metrics.jsonl", source="actor")
    old.write({"step": 1})  # an earlier start's record: it does not count as progress of this one
    dog = Watchdog(cfg, tmp_path)
    rollout = MetricsWriter(tmp_path / "metrics.jsonl", source="rollout")
    rollout.write({"first_failure": "group e0-i3 (prompt p): env timeout: Env.step took longer than 30 s"})
    t0 = time.monotonic()
    step = 1
    while (failure := dog.check()) is None:
        if time.monotonic() - t0 < 1.0:  # steps for a second, then none
            step += 1
            old.write({"step": step})
            last_step = time.monotonic()
        assert time.monotonic() - t0 < 20, "the stall was never reported"
        time.sleep(0.1)
    assert time.monotonic() - last_step >= 1.5  # counted from the last step, not from the start
    assert failure["source"] == "launcher"
    assert failure["reason"].startswith("no training step for ")
    assert failure["reason"].endswith(
        "s (run.stall_timeout_s = 1.5); first rollout failure: group e0-i3 (prompt p): env timeout: Env.step took "
        "longer than 30 s"
    )
    assert dog.check() == failure  # recorded once; the first cause stays


@pytest.mark.slow
def test_a_broken_env_stops_the_run_after_a_checkpoint_with_one_line(tmp_path) -> None:
    env = tmp_path / "answers42.py"
    env.write_text(RETURNS_42)
    cmd = [str(BIN / "molt-hpc"), "run", "configs/tiny_cpu.toml", "--set", f"run.root={tmp_path}",
           "--set", f"rollout.agent={env}", "--set", "rollout.max_consecutive_failures=8",
           "--set", "logging.progress=lines"]  # fmt: skip
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert out.returncode == 1, out.stderr
    run = tmp_path / "tiny-cpu"
    errors = [line for line in out.stderr.splitlines() if "[launcher] run stopped: " in line]
    assert len(errors) == 1 and "Traceback" not in out.stderr + out.stdout, out.stderr
    assert "8 groups failed in a row (rollout.max_consecutive_failures = 8); first failure: group e0-i" in errors[0]
    assert "Env.step returned int, not a Result" in errors[0]
    # The trainer checkpointed (at step 0: nothing was trained) before everything stopped.
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_000000"
    assert f"continue with: molt-hpc run --resume {run}" in errors[0]
    procs = json.loads((run / "processes.json").read_text())
    assert all(not Path(f"/proc/{pid}").exists() for pid in procs.values()), "a process was left running"
    assert processes_mentioning(str(run)) == []
    pool_log = (run / "logs" / "pool.log").read_text()
    assert "restarting" not in pool_log  # a clean stop of the pool is not a death
