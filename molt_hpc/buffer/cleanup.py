"""Removing a run's `/dev/shm` spool: memory that outlives the run unless someone frees it.

A finished run (`control/done`) has its shm spool removed by the launcher that ran it, once every
process has stopped; a stopped run keeps it, since a resume starts from it. `molt-hpc buffer clean
RUN_DIR` removes it by hand and refuses while the run is live (a recorded process alive, or its
Slurm job still holding an allocation). What stays behind is `RUN_DIR/buffer/removed`, saying when
and where, so `buffer stats` and `status` explain the missing spool instead of showing an empty one.
The `fs` backend's spool is the run directory's own ledger and is never removed here.
"""

import json
import os
import shutil
import time
from pathlib import Path

from molt_hpc.buffer.spool import LOCATION_FILE
from molt_hpc.rundir import atomic_write

REMOVED_FILE = "removed"


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists (one owned by another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def live_reason(run_dir: str | Path) -> str | None:
    """Why the run counts as live (a recorded process alive, an active Slurm job), or None."""
    run_dir = Path(run_dir)
    procs = run_dir / "processes.json"
    if procs.exists():
        for name, pid in json.loads(procs.read_text()).items():
            if pid and pid_alive(int(pid)):
                return f"its {name} (pid {pid}) is running"
    from molt_hpc.launch.slurm_state import ACTIVE_STATES, job_state, read_job_id

    job_id = read_job_id(run_dir)
    state = job_state(job_id) if job_id is not None else None
    if state in ACTIVE_STATES:
        return f"its Slurm job {job_id} is {state}"
    return None


def shm_spool(run_dir: str | Path) -> Path | None:
    """The run's spool outside the run directory (`buffer/location`), or None for the `fs` backend."""
    pointer = Path(run_dir) / "buffer" / LOCATION_FILE
    return Path(pointer.read_text().strip()) if pointer.exists() else None


def remove_spool(run_dir: str | Path) -> Path | None:
    """Remove the run's shm spool and its pointer, leaving `buffer/removed`; the path removed, or None."""
    run_dir = Path(run_dir)
    root = shm_spool(run_dir)
    if root is None:
        return None
    shutil.rmtree(root, ignore_errors=True)
    note = f"{root} removed at {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
    atomic_write(run_dir / "buffer" / REMOVED_FILE, note)
    (run_dir / "buffer" / LOCATION_FILE).unlink(missing_ok=True)
    return root


def release_finished(run_dir: str | Path) -> Path | None:
    """The launcher's end of a run: remove the shm spool if training finished; a stopped run keeps it."""
    if not (Path(run_dir) / "control" / "done").exists():
        return None
    return remove_spool(run_dir)


def clean(run_dir: str | Path) -> str:
    """`molt-hpc buffer clean RUN_DIR`: what was done, or a ValueError (live run, not a run directory)."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.toml").is_file():
        raise ValueError(f"{run_dir} is not a run directory (no config.toml)")
    reason = live_reason(run_dir)
    if reason is not None:
        raise ValueError(f"{run_dir} is live ({reason}): stop it first (Ctrl-C, or molt-hpc cancel {run_dir})")
    root = shm_spool(run_dir)
    if root is None:
        removed = run_dir / "buffer" / REMOVED_FILE
        if removed.exists():
            return f"nothing to remove: {removed.read_text().strip()}"
        return f"nothing to remove: {run_dir} keeps its buffer in {run_dir / 'buffer'} (buffer.backend = 'fs')"
    remove_spool(run_dir)
    return f"removed {root}"
