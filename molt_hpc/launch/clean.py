"""`molt-hpc buffer clean RUN_DIR`: a run's `/dev/shm` spool removed by hand, refused while the run is live
(a recorded process alive, or its Slurm job still holding an allocation)."""

import json
from pathlib import Path

from molt_hpc.buffer.cleanup import REMOVED_FILE, pid_alive, remove_spool, shm_spool
from molt_hpc.launch.slurm.state import ACTIVE_STATES, job_state, read_job_id


def live_reason(run_dir: str | Path) -> str | None:
    """Why the run counts as live (a recorded process alive, an active Slurm job), or None."""
    run_dir = Path(run_dir)
    procs = run_dir / "processes.json"
    if procs.exists():
        for name, pid in json.loads(procs.read_text()).items():
            if pid and pid_alive(int(pid)):
                return f"its {name} (pid {pid}) is running"
    job_id = read_job_id(run_dir)
    state = job_state(job_id) if job_id is not None else None
    if state in ACTIVE_STATES:
        return f"its Slurm job {job_id} is {state}"
    return None


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
