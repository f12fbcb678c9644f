"""Removing a run's `/dev/shm` spool: memory that outlives the run unless someone frees it.

A finished run (`control/done`) has its shm spool removed by the launcher that ran it, once every
process has stopped; a stopped run keeps it, since a resume starts from it. `molt-hpc buffer clean
RUN_DIR` removes it by hand (`molt_hpc.launch.clean`: it knows the run's processes and Slurm job). What
stays behind is `RUN_DIR/buffer/removed`, saying when
and where, so `buffer stats` and `status` explain the missing spool instead of showing an empty one.
The `fs` backend's spool is the run directory's own ledger and is never removed here.
"""

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
