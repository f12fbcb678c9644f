"""The driver of one heterogeneous Slurm job; it runs as the batch shell on the actor pool's first node.

It starts the two job steps (slurm_steps.py), watches them and owns the job's lifecycle:
- training finished (the actor step exits 0 after writing `control/done`): stop the engine pool, end;
- the actor step fails: stop the engine pool and fail the job, so no node idles on a dead run;
- the engine step dies: relaunch it in the same allocation, up to `slurm.max_engine_restarts` times,
  while the actor pool keeps its state; past that, the actor checkpoints and the job fails;
- the time-limit warning (SIGUSR1, `--signal=B:USR1@lead`) or a preemption (SIGTERM): write
  `control/stop` (the actor pool checkpoints at the next step boundary), wait for it (bounded), stop
  the pool, `scontrol requeue`; the requeued job starts here again and resumes from `latest`;
- `control/cancel` (`molt-hpc cancel`): the same checkpoint, then the job is cancelled, not requeued.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from molt_hpc.config import MoltConfig, load_config
from molt_hpc.launch.procs import Child
from molt_hpc.launch.slurm_state import control_file, record_job_id, touch_control
from molt_hpc.log import get_logger, setup_logging
from molt_hpc.rundir import RunDir
from molt_hpc.trackers import Trackers

POLL_S = 0.5
POOL_STOP_S = 15.0
REQUEUED_EXIT = 0
STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


class DriverError(RuntimeError):
    """The run cannot go on in this job; the message says why and how to continue."""


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
        return drive(Path(self.run_dir))

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
    cfg = run_config(run_dir)
    log = setup_logging("driver", cfg.logging.level, file=run_dir / "logs" / "driver.log")
    job_id = os.environ.get("SLURM_JOB_ID")
    if job_id is None:
        raise DriverError("SLURM_JOB_ID is not set: the driver runs as the batch script of a Slurm job")
    record_job_id(run_dir, job_id)
    log.info("job %s, start %s, run %s", job_id, int(os.environ.get("SLURM_RESTART_COUNT", "0")) + 1, run_dir)
    if control_file(run_dir, "cancel").exists():
        log.info("the run was cancelled (control/cancel); ending the job")
        return _cancel_job(job_id)
    from molt_hpc.launch.local import prepare_run  # builds a builtin model: heavy imports, here only
    from molt_hpc.launch.slurm_steps import job_steps

    prepare_run(cfg)
    actor, pool = job_steps(cfg, run_dir, job_id)
    trackers = Trackers(cfg.logging, RunDir(run_dir), cfg.run.name)
    try:
        for step in (actor, pool):
            step.start()
            log.info("started %s: %s", step.name, " ".join(step.cmd))
        return Lifecycle(cfg, run_dir, job_id, actor, pool, signals, trackers).run()
    finally:
        trackers.close()
        for step in (pool, actor):  # whatever happened, no step outlives the driver
            if step.proc is not None and step.poll() is None:
                step.stop(POOL_STOP_S)


class Lifecycle:
    """The watch loop and what follows it; one instance per job start."""

    def __init__(
        self, cfg: MoltConfig, run_dir: Path, job_id: str, actor: Child, pool: Child, signals: StopSignals, trackers
    ):
        self.cfg, self.run_dir, self.job_id, self.trackers = cfg, run_dir, job_id, trackers
        self.actor, self.pool, self.signals = actor, pool, signals
        self.log = get_logger()

    def done(self) -> bool:
        return control_file(self.run_dir, "done").exists()

    def run(self) -> dict[str, object]:
        outcome = self.watch()
        if outcome == "done":
            self.pool.stop(POOL_STOP_S)
            self.log.info("training finished; engine pool stopped after %d relaunches", self.pool.restarts)
            self.release_buffer()
            return {"status": "done", "engine_restarts": self.pool.restarts}
        if outcome == "engines failed":
            self.checkpoint_and_stop_actor()
            raise DriverError(
                f"the engine pool died {self.pool.restarts + 1} times (slurm.max_engine_restarts = "
                f"{self.cfg.slurm.max_engine_restarts}); see {self.pool.log}. The actor pool checkpointed; "
                f"continue with: molt-hpc submit --resume {self.run_dir}"
            )
        return self.stop_and_leave(outcome)

    def release_buffer(self) -> None:
        """Training finished and both steps stopped: free the run's /dev/shm spool (shm backend)."""
        from molt_hpc.buffer.cleanup import release_finished

        removed = release_finished(self.run_dir)
        if removed is not None:
            self.log.info("removed the finished run's replay buffer %s", removed)

    def watch(self) -> str:
        """Poll both steps until one of: done, stop (signal), cancel, engines failed (or raise)."""
        while True:
            time.sleep(POLL_S)
            self.trackers.update()
            if self.signals.received:
                return "stop"
            if control_file(self.run_dir, "cancel").exists():
                return "cancel"
            code = self.actor.poll()
            if code is not None:
                if code == 0 and self.done():
                    return "done"
                self.pool.stop(POOL_STOP_S)
                raise DriverError(
                    f"the actor pool step exited with code {code} before training finished; last lines of "
                    f"{self.actor.log}:\n{self.actor.tail()}\ncontinue with: molt-hpc submit --resume {self.run_dir}"
                )
            code = self.pool.poll()
            if code is not None and not self.done():
                if self.pool.restarts >= self.cfg.slurm.max_engine_restarts:
                    return "engines failed"
                self.pool.restarts += 1
                self.log.warning(
                    "the engine pool step exited with code %s; relaunching it (%d/%d); last lines:\n%s",
                    code, self.pool.restarts, self.cfg.slurm.max_engine_restarts, self.pool.tail(),
                )  # fmt: skip
                self.pool.start()

    def checkpoint_and_stop_actor(self) -> bool:
        """Ask the actor pool to checkpoint at the next step boundary and exit; True if it did in time."""
        wait_s = self.cfg.slurm.stop_wait_s
        touch_control(self.run_dir, "stop")
        deadline = time.monotonic() + wait_s
        while self.actor.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        code = self.actor.poll()
        if code is None:
            self.log.error("the actor pool did not checkpoint within %d s (slurm.stop_timeout_s); stopping it", wait_s)
            self.actor.stop(POOL_STOP_S)
            return False
        self.log.info("the actor pool stopped (exit %s) after its checkpoint", code)
        return code == 0

    def stop_and_leave(self, outcome: str) -> dict[str, object]:
        """A signal or a cancel: checkpoint, stop the pool, then requeue, cancel or fail the job."""
        reason = self.signals.received or "control/cancel"
        self.log.info("%s: the actor pool checkpoints at the next step boundary", reason)
        self.checkpoint_and_stop_actor()
        self.pool.stop(POOL_STOP_S)
        if self.done():
            self.log.info("training finished while stopping")
            self.release_buffer()
            return {"status": "done", "engine_restarts": self.pool.restarts}
        if outcome == "cancel" or control_file(self.run_dir, "cancel").exists():
            return _cancel_job(self.job_id)
        if not self.cfg.slurm.requeue:
            raise DriverError(
                f"stopped by {reason} after a checkpoint and slurm.requeue is off; continue with: "
                f"molt-hpc submit --resume {self.run_dir}"
            )
        out = subprocess.run(["scontrol", "requeue", self.job_id], capture_output=True, text=True)
        if out.returncode:
            raise DriverError(
                f"scontrol requeue {self.job_id} failed ({out.stderr.strip()}); the checkpoint is safe: "
                f"continue with: molt-hpc submit --resume {self.run_dir}"
            )
        self.log.info("requeued job %s; it resumes from the checkpoint", self.job_id)
        sys.exit(REQUEUED_EXIT)  # SystemExit: submitit writes no result, the requeued job runs it again


def _cancel_job(job_id: str) -> dict[str, object]:
    """End the job as CANCELLED (its steps are already stopped), so Slurm's record says what happened."""
    get_logger().info("cancelling job %s", job_id)
    subprocess.run(["scancel", job_id], capture_output=True)
    return {"status": "cancelled"}


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
        result = drive(Path(run_dir).absolute())
    except (DriverError, ValueError) as err:  # a message for the user (and the job log), not a bug report
        get_logger().error("%s", err)
        return 1
    get_logger().info("job ended: %s", result)
    return 0
