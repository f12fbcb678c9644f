"""The real entry points as one heterogeneous job on the local cluster, through `molt-hpc submit`:
the tiny CPU config, preempted a third of the way in, runs to completion, learns, and trains exactly
the groups an uninterrupted run trains: `groups_per_step` distinct groups per step, none lost, none
twice. The preemption is real: a job of the higher-priority partition takes the run's engine node.

One run keeps this within minutes on two cores (about 7 s per step when two runs share them).
"""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from molt_hpc.buffer.spool import acked_ids, find_spool
from molt_hpc.config import load_config
from molt_hpc.log import read_metrics
from tests.conftest import ROOT, molt

pytest_plugins = ["tests.slurm_cluster"]
pytestmark = [pytest.mark.slurm, pytest.mark.slow]

CONFIG = ROOT / "configs" / "tiny_cpu.toml"
STEPS = 30  # the tiny config's reward rises within 30 steps (it doubles by 60)


def missing_entry_points() -> str | None:
    """Why the real pools cannot run as job steps yet, or None."""
    for script in ("actor.py", "engine.py"):
        if not (ROOT / "jobs" / script).exists():
            return f"jobs/{script} does not exist yet"
    usage = subprocess.run([sys.executable, "jobs/engine.py", "--help"], cwd=ROOT, capture_output=True, text=True)
    if "pool" not in usage.stdout:
        return "jobs/engine.py has no `--role pool` yet (one node's engines, router and orchestrator)"
    return None


def actor_steps(run: Path) -> list[dict]:
    return [r for r in read_metrics(run / "metrics.jsonl", source="actor") if "step" in r]


@pytest.fixture(scope="module")
def preempted_run(slurm_cluster, tmp_path_factory) -> tuple[str, Path]:
    reason = missing_entry_points()
    if reason:
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("e2e")
    overrides = [f"run.root={root}", f"run.steps={STEPS}"]
    result = molt("submit", str(CONFIG), *[a for o in overrides for a in ("--set", o)])
    assert result.returncode == 0, result.stderr
    job, run = re.search(r"submitted job (\d+)", result.stdout).group(1), root / "tiny-cpu"
    slurm_cluster.wait_for(lambda: len(actor_steps(run)) >= STEPS // 3, 300, "a third of the run", interval=1)
    _, engine_node = slurm_cluster.component_nodes(job)
    urgent = slurm_cluster.slurm("sbatch", "--parsable", "-p", "urgent", "-w", engine_node, "-c", "4",
                                 "-o", "/dev/null", "--wrap", "sleep 5").strip()  # fmt: skip
    assert slurm_cluster.wait_end(job, 500) == "COMPLETED"
    assert slurm_cluster.wait_end(urgent, 60) == "COMPLETED"
    return job, run


def test_tiny_config_runs_as_a_het_job_to_completion_and_learns(preempted_run) -> None:
    _, run = preempted_run
    records = actor_steps(run)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))  # each step once, across the requeue
    rewards = [r["reward"] for r in records]
    quarter = len(rewards) // 4
    first, last = sum(rewards[:quarter]) / quarter, sum(rewards[-quarter:]) / quarter
    assert last > first, f"no learning: mean reward {first:.4f} in the first quarter, {last:.4f} in the last"


def test_preempted_run_trains_the_groups_of_an_uninterrupted_run(slurm_cluster, preempted_run) -> None:
    job, run = preempted_run
    assert slurm_cluster.job_field(job, "Restarts") == "1"
    assert "SIGUSR1: the actor pool checkpoints" in (run / "logs" / "driver.log").read_text()
    trained = acked_ids(find_spool(run))
    assert len(trained) == len(set(trained)), "a group was trained twice"
    assert len(trained) == STEPS * load_config(CONFIG).actor.groups_per_step, "groups were lost or added"
