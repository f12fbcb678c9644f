"""The driver of one heterogeneous Slurm job; it runs as the batch shell on the actor pool's first node.

It starts the job steps (steps.py) and hands them to the `Lifecycle` (lifecycle.py),
which watches them and ends, requeues or fails the job. Whatever fails the job, its reason goes to
`logs/driver.log` and is recorded as the run's failure (`control/failed`), which `molt-hpc status`
prints; submitit's own files keep the traceback.
"""

import json
import os
import signal
from pathlib import Path

from molt_hpc.config import MoltConfig, load_config
from molt_hpc.fault import fail
from molt_hpc.launch.slurm.lifecycle import POOL_STOP_S, DriverError, Lifecycle, cancel_job
from molt_hpc.launch.slurm.state import control_file, record_job_id
from molt_hpc.log import get_logger, setup_logging
from molt_hpc.rundir import RunDir
from molt_hpc.trackers import Trackers

__all__ = ["POOL_STOP_S", "DriverError", "SlurmDriver", "drive", "main", "run_config"]

STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


class StopSignals:
    """Remembers the first warning or termination signal; the watch loop acts on it (not the handler)."""

    def __init__(self) -> None:
        self.received: str | None = None
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._on_signal)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # jobs/driver.py blocks them until now

    def _on_signal(self, signum: int, _frame: object) -> None:
        self.received = self.received or signal.Signals(signum).name


class SlurmDriver:
    """The callable submitit runs in the batch shell (picklable: it holds only the run directory)."""

    def __init__(self, run_dir: str | Path):
        self.run_dir = str(run_dir)

    def __call__(self) -> dict[str, object]:
        return drive_and_record(Path(self.run_dir))

    def checkpoint(self) -> object:
        """submitit calls this when the warning arrives before `drive` took over the signals: no step
        has started yet, so the same driver is simply requeued."""
        from submitit.helpers import DelayedSubmission

        return DelayedSubmission(self)


def run_config(run_dir: Path) -> MoltConfig:
    """The resolved config of the run, pointed at the directory wherever it is now."""
    where = [f"run.root={json.dumps(str(run_dir.parent))}", f"run.name={json.dumps(run_dir.name)}"]
    return load_config(run_dir / "config.toml", where)


def drive(run_dir: Path) -> dict[str, object]:
    """Run this job's share of the run; returns `{"status": ...}` or raises DriverError."""
    signals = StopSignals()
    setup_logging("driver", file=run_dir / "logs" / "driver.log")  # first: every failure below lands in it
    cfg = run_config(run_dir)
    log = setup_logging("driver", cfg.logging.level, file=run_dir / "logs" / "driver.log")
    job_id = os.environ.get("SLURM_JOB_ID")
    if job_id is None:
        raise DriverError("SLURM_JOB_ID is not set: the driver runs as the batch script of a Slurm job")
    record_job_id(run_dir, job_id)
    restart = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
    log.info("job %s, start %d, run %s", job_id, restart + 1, run_dir)
    if control_file(run_dir, "cancel").exists():
        log.info("the run was cancelled (control/cancel); ending the job")
        return cancel_job(job_id)
    from molt_hpc.launch.local import prepare_run  # builds a builtin model: heavy imports, here only
    from molt_hpc.launch.slurm.steps import job_steps

    prepare_run(cfg)
    actor, pool = job_steps(cfg, run_dir, job_id)
    trackers = Trackers(cfg.logging, RunDir(run_dir), cfg.run.name)
    try:
        for step in (actor, pool):
            step.start()
            log.info("started %s: %s", step.name, " ".join(step.cmd))
        return Lifecycle(cfg, run_dir, job_id, actor, pool, signals, restart, trackers).run()
    finally:
        trackers.close()
        for step in (pool, actor):  # whatever happened, no step outlives the driver (stop skips ended ones)
            step.stop(POOL_STOP_S)


def drive_and_record(run_dir: Path) -> dict[str, object]:
    """`drive`, with the reason of a failed job written to `logs/driver.log` and recorded for `status`."""
    try:
        return drive(run_dir)
    except (DriverError, ValueError) as err:  # a message for the user, not a bug report
        get_logger().error("job failed: %s", err)
        fail(run_dir, str(err).splitlines()[0], "driver", config_error=getattr(err, "config_error", True))
        raise
    except Exception as err:
        get_logger().exception("job failed: the driver crashed")
        fail(run_dir, f"the Slurm driver crashed: {type(err).__name__}: {err} (see logs/driver.log)", "driver")
        raise


def main(run_dir: str | Path, config_text: str | None = None) -> int:
    """`jobs/driver.py`: optionally write the run directory from a resolved config, then drive."""
    if config_text is not None:
        import tomllib

        from molt_hpc.config import to_toml
        from molt_hpc.config.load import validate
        from molt_hpc.rundir import create_run_dir

        cfg = validate(tomllib.loads(config_text), "the config in the batch script")
        create_run_dir(Path(run_dir).absolute().parent, Path(run_dir).name, to_toml(cfg))
    try:
        result = drive_and_record(Path(run_dir).absolute())
    except (DriverError, ValueError):  # logged and recorded: the job fails with that message
        return 1
    get_logger().info("job ended: %s", result)
    return 0
