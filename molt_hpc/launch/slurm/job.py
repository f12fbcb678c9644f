"""Slurm mode: a run is ONE heterogeneous job (het group 0 = actor pool, het group 1 = engine pool).

    submit(cfg)              check, create the run directory, submit the driver through submitit
    dry_run_script(cfg)      the exact batch script `submit` would hand to sbatch; creates nothing
    standalone_script(cfg)   a script for `sbatch FILE` by hand; it runs the same driver
    cancel(run_dir)          checkpoint, then end the job (or at once with now=True)
    slurm_job_state(run_dir) the Slurm state of the run's job, for `molt-hpc status`

The driver that runs inside the job is driver.py; the script templates live in `slurm/`.
"""

import shutil
import subprocess
import time
from pathlib import Path

from molt_hpc import fault
from molt_hpc.config import MoltConfig, to_toml
from molt_hpc.launch.slurm.checks import preflight
from molt_hpc.launch.slurm.render import standalone_script as _standalone
from molt_hpc.launch.slurm.render import submitit_command, submitit_script
from molt_hpc.launch.slurm.state import (
    ACTIVE_STATES,
    control_file,
    job_state,
    read_job_id,
    record_job_id,
    slurm_job_state,
    touch_control,
)
from molt_hpc.rundir import create_run_dir

__all__ = ["cancel", "dry_run_script", "slurm_job_state", "standalone_script", "submit"]

CANCEL_MARGIN_S = 60.0


def run_path(cfg: MoltConfig) -> Path:
    return Path(cfg.run.root).absolute() / cfg.run.name


def dry_run_script(cfg: MoltConfig) -> str:
    folder = run_path(cfg) / "submitit"
    return submitit_script(cfg, folder, submitit_command(folder), Path.cwd())


def standalone_script(cfg: MoltConfig) -> str:
    return _standalone(cfg, run_path(cfg), Path.cwd())


def _check_model(cfg: MoltConfig) -> None:
    from molt_hpc.trackers import check_optional_packages

    check_optional_packages(cfg)  # a missing tracker or router package fails here, not in the job
    if not cfg.model.is_builtin:
        from molt_hpc.models import check_model_dir

        check_model_dir(Path(cfg.model.path).expanduser())


def _check_run_dir(run: Path, resume: bool) -> None:
    if not resume and (run / "config.toml").exists():
        raise ValueError(
            f"run directory {run} already exists: continue it with `molt-hpc submit --resume {run}` "
            "or pick another run.name"
        )
    if resume:
        job_id = read_job_id(run)
        state = job_state(job_id) if job_id else None
        if state in ACTIVE_STATES:
            raise ValueError(f"job {job_id} of {run} is still {state}: wait for it or `molt-hpc cancel {run}` first")


def submit(cfg: MoltConfig, *, resume: bool = False) -> tuple[str, Path]:
    """Submit `cfg` (a new run, or `resume` the one in its run directory); returns (job id, run dir)."""
    from submitit.core.utils import FailedJobError

    from molt_hpc.launch.slurm.driver import SlurmDriver
    from molt_hpc.launch.slurm.executor import HetSlurmExecutor

    preflight(cfg)
    _check_model(cfg)
    run = run_path(cfg)
    _check_run_dir(run, resume)
    created = not run.exists()
    create_run_dir(run.parent, run.name, to_toml(cfg))
    for name in ("cancel", "stop"):  # requests meant for an earlier job of this run
        control_file(run, name).unlink(missing_ok=True)
    fault.clear(run)  # and why that job stopped: this one starts clean
    try:
        executor = HetSlurmExecutor(run / "submitit", cfg, workdir=Path.cwd())
        job = executor.submit(SlurmDriver(run))
    except FailedJobError as err:
        if created:  # leave no run directory that looks like a submitted run
            shutil.rmtree(run, ignore_errors=True)
        message = str(err).strip().splitlines()
        raise ValueError(f"Slurm refused the job: {message[-1] if message else err}") from None
    record_job_id(run, job.job_id)
    return job.job_id, run


def cancel(run_dir: str | Path, *, now: bool = False, timeout_s: float | None = None) -> str:
    """End the run's job: after a checkpoint (the driver reads `control/cancel`), or at once with `now`."""
    run = Path(run_dir).absolute()
    job_id = read_job_id(run)
    if job_id is None:
        raise ValueError(f"{run} has no Slurm job on record ({run / 'slurm_job_id'}); was it submitted with Slurm?")
    state = job_state(job_id)
    if state not in ACTIVE_STATES:
        raise ValueError(f"job {job_id} of {run} is not active ({state or 'unknown to Slurm'}): nothing to cancel")
    touch_control(run, "cancel")  # also stops a requeued incarnation that starts meanwhile
    if now or state != "RUNNING":
        _scancel(job_id)
        return f"cancelled job {job_id} ({'at once' if now else state})"
    if timeout_s is None:
        from molt_hpc.launch.slurm.driver import POOL_STOP_S, run_config

        timeout_s = run_config(run).slurm.stop_wait_s + POOL_STOP_S + CANCEL_MARGIN_S
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = job_state(job_id)
        if state not in ACTIVE_STATES:
            return f"job {job_id} ended after its checkpoint ({state or 'gone'})"
        if state in ("PENDING", "REQUEUED", "REQUEUE_HOLD"):  # requeued just before the request
            _scancel(job_id)
            return f"cancelled job {job_id} (it was {state})"
        time.sleep(1.0)
    _scancel(job_id)
    return f"job {job_id} did not end within {timeout_s:.0f} s of the checkpoint request; cancelled it now"


def _scancel(job_id: str) -> None:
    out = subprocess.run(["scancel", job_id], capture_output=True, text=True)
    if out.returncode:
        raise ValueError(f"scancel {job_id} failed: {out.stderr.strip()}")
