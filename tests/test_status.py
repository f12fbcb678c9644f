"""`molt-hpc status` and the plot read a run's records as the run's current history: after a crash and a
resume from an earlier checkpoint, each step counts once (its last record), and a recorded failure shows."""

from pathlib import Path

from molt_hpc.config import load_config, to_toml
from molt_hpc.fault import fail
from molt_hpc.log import MetricsWriter, read_metrics, training_steps
from molt_hpc.rundir import create_run_dir
from tests.conftest import molt


def crashed_and_resumed(root: Path) -> Path:
    """Steps 1-7 trained, a crash, a resume from the step-4 checkpoint that trained steps 5-10."""
    run = create_run_dir(root, "r", to_toml(load_config(None, ["run.steps=10"])))
    actor = MetricsWriter(run.metrics, source="actor")
    rollout = MetricsWriter(run.metrics, source="rollout")
    for step in range(1, 8):
        actor.write({"step": step, "reward": 0.0})
        rollout.write({"groups_accepted": 8})
    for step in range(5, 11):
        actor.write({"step": step, "reward": 1.0})
    return run.path


def test_each_step_counts_once_after_a_crash_resume(tmp_path: Path) -> None:
    run = crashed_and_resumed(tmp_path)
    records = read_metrics(run / "metrics.jsonl", source="actor")
    assert len(records) == 13
    steps = training_steps(records)
    assert [r["step"] for r in steps] == list(range(1, 11))
    assert [r["reward"] for r in steps] == [0.0] * 4 + [1.0] * 6  # the abandoned 5-7 are gone
    out = molt("status", str(run))
    assert out.returncode == 0, out.stderr
    assert "step: 10/10" in out.stdout
    assert "reward: first quarter 0.000 -> last quarter 1.000 (best 1.000 at step 5, 10 steps)" in out.stdout
    assert "processes: none recorded" in out.stdout and "failed" not in out.stdout


def test_status_prints_why_the_run_stopped(tmp_path: Path) -> None:
    run = crashed_and_resumed(tmp_path)
    fail(run, "5 groups failed in a row (rollout.max_consecutive_failures = 5); first failure: env raised", "rollout")
    fail(run, "a later consequence", "launcher")  # the first cause stays
    out = molt("status", str(run))
    [line] = [line for line in out.stdout.splitlines() if line.startswith("failed")]
    assert line.startswith("failed (rollout, ") and line.endswith(
        "s ago): 5 groups failed in a row (rollout.max_consecutive_failures = 5); first failure: env raised"
    )
