"""Extra engine pools of a live run: their records in the run directory, and what they are doing.

An extra pool is a set of engines started after the run (`molt-hpc engines add`): processes on this
machine (`local`) or a Slurm job of its own (`slurm`). Each has a record `RUN_DIR/pools/<name>.json`
(its engines' indices, the supervisor's pid or the job id, its state) and its resolved config
`RUN_DIR/pools/<name>.toml` (the run's, with the pool's count, kind and `--set` overrides). Its
engines register like the run's own (`rendezvous/engine-<index>.json`, indices from `FIRST_INDEX`
on), so the router and the trainer's refit take them without knowing about pools.

On a launch or resume of the run, `reconcile` keeps the pools that still run (they serve on, and are
refitted like any engine that registers) and forgets those that ended: state `ended`, their engines'
registrations removed so neither the router nor a refit waits for them.
"""

import contextlib
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from molt_hpc.rundir import RunDir, atomic_write

FIRST_INDEX = 1000
"""Engine indices of extra pool n are `n * FIRST_INDEX + i`: clear of the run's own engines."""
LIVE = ("starting", "serving", "draining")


@dataclass
class PoolRecord:
    """One extra pool, as `RUN_DIR/pools/<name>.json` holds it."""

    name: str
    mode: str
    """`local` (processes on the machine that added it) or `slurm` (a job of its own)."""
    kind: str
    """Its engines' kind (`engines.kind`)."""
    indices: list[int]
    state: str = "starting"
    """`starting`, `serving`, `draining`, `removed` (by `engines remove`) or `ended` (it stopped by itself)."""
    pid: int | None = None
    """The local pool's supervisor process."""
    job_id: str | None = None
    """The Slurm pool's job."""
    host: str = field(default_factory=lambda: os.uname().nodename)
    added_at: float = field(default_factory=time.time)

    @property
    def live(self) -> bool:
        return self.state in LIVE


def pools_dir(run: RunDir) -> Path:
    return run.path / "pools"


def record_path(run: RunDir, name: str) -> Path:
    return pools_dir(run) / f"{name}.json"


def config_path(run: RunDir, name: str) -> Path:
    return pools_dir(run) / f"{name}.toml"


def save(run: RunDir, record: PoolRecord) -> None:
    pools_dir(run).mkdir(mode=0o700, exist_ok=True)
    atomic_write(record_path(run, record.name), json.dumps(asdict(record), indent=1))


def load(run: RunDir, name: str) -> PoolRecord:
    path = record_path(run, name)
    if not path.is_file():
        known = ", ".join(r.name for r in records(run)) or "none"
        raise ValueError(f"the run at {run.path} has no pool {name!r} (its pools: {known})")
    return PoolRecord(**json.loads(path.read_text()))


def records(run: RunDir) -> list[PoolRecord]:
    """Every pool the run ever had, oldest first."""
    out = []
    for path in sorted(pools_dir(run).glob("*.json")) if pools_dir(run).is_dir() else []:
        with contextlib.suppress(OSError, ValueError, TypeError):  # half-written by a crash: not a pool
            out.append(PoolRecord(**json.loads(path.read_text())))
    return sorted(out, key=lambda r: r.indices[0] if r.indices else 0)


def next_pool(run: RunDir) -> tuple[str, int]:
    """(name, first engine index) of the next pool: `pool-<n>`, indices `n * FIRST_INDEX` on."""
    n = 1 + max((r.indices[0] // FIRST_INDEX for r in records(run) if r.indices), default=0)
    return f"pool-{n}", n * FIRST_INDEX


def pid_alive(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):  # gone, or someone else's process took the pid
        return False
    try:  # an exited child not yet reaped by its parent answers kill(0) too
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):  # no /proc here: kill(0) is the answer
        return True


def running(record: PoolRecord, slurm_state=None) -> bool:
    """Whether the pool's processes (or job) still run; `slurm_state(job_id)` answers for Slurm pools."""
    if record.mode == "local":
        return record.host == os.uname().nodename and pid_alive(record.pid)
    if slurm_state is None:  # no way to ask Slurm from here: its scheduler keeps the job, so it is kept too
        return True
    return slurm_state(record.job_id) in ("PENDING", "RUNNING", "CONFIGURING", "REQUEUED")


def unregister(run: RunDir, indices: list[int]) -> None:
    """Remove the registrations of these engines (the router drops them, a refit no longer waits for them)."""
    for index in indices:
        (run.rendezvous / f"engine-{index}.json").unlink(missing_ok=True)


def reconcile(run: RunDir, slurm_state=None) -> list[PoolRecord]:
    """At a launch or resume: keep the live pools that still run, forget the rest; the live pools."""
    kept = []
    for record in records(run):
        if not record.live:
            continue
        if running(record, slurm_state):
            kept.append(record)
            continue
        record.state = "ended"
        unregister(run, record.indices)
        save(run, record)
    return kept
