"""Helpers of the Slurm job tests (`test_slurm_jobs.py`, `test_slurm_span.py`): submitting the tiny config
with the pool stand-ins, and reading what the stand-ins logged (`RUN_DIR/standin/*.jsonl`)."""

import json
import re
from pathlib import Path

from submitit import SlurmJob

from tests.conftest import ROOT, molt

STANDINS = [
    f"slurm.actor_script={ROOT / 'tests' / 'slurm_standin_actor.py'}",
    f"slurm.engine_script={ROOT / 'tests' / 'slurm_standin_engine.py'}",
    "slurm.actor.cpus_per_task=1",
    "slurm.engines.cpus_per_task=1",
]


def sets(*overrides: str) -> list[str]:
    return [arg for item in overrides for arg in ("--set", item)]


def standin_args(root: Path, model: Path, name: str, *overrides: str) -> list[str]:
    return sets(f"run.root={root}", f"run.name={name}", f"model.path={model}", *STANDINS, *overrides)


def submit(root: Path, model: Path, name: str, *overrides: str, env: dict | None = None) -> tuple[str, Path]:
    """`molt-hpc submit` of the tiny config with the stand-ins; returns (job id, run directory)."""
    result = molt("submit", *standin_args(root, model, name, *overrides), env=env)
    assert result.returncode == 0, result.stderr
    job_id = re.search(r"submitted job (\d+)", result.stdout).group(1)
    assert f"run directory {root / name}" in result.stdout
    return job_id, root / name


def events(run: Path, who: str, kind: str | None = None) -> list[dict]:
    path = run / "standin" / f"{who}.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [e for e in map(json.loads, lines) if kind is None or e["event"] == kind]


def trained_steps(run: Path) -> list[int]:
    """Every step the actor pool trained, in order, over all job starts."""
    return [e["step"] for e in events(run, "actor", "step")]


def driver_result(run: Path, job_id: str) -> object:
    """What the driver returned (or raised) in its last start, as submitit reports it."""
    return SlurmJob(run / "submitit", job_id).result()


def assert_each_step_once(run: Path, steps: int) -> None:
    """No step lost or trained twice across requeues: each stop checkpointed at its step boundary."""
    assert trained_steps(run) == list(range(1, steps + 1))
    checkpoints = events(run, "actor", "checkpoint")
    for start in [s for s in events(run, "actor", "start") if s["rank"] == 0]:
        before = [c["step"] for c in checkpoints if c["time"] < start["time"]]
        assert start["resume_step"] == max(before, default=0), "a start did not resume from the newest checkpoint"


def on_nodes(actor: str, engines: str) -> list[str]:
    return [f'slurm.actor.extra_sbatch=["--nodelist={actor}"]', f'slurm.engines.extra_sbatch=["--nodelist={engines}"]']
