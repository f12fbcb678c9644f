"""What the Slurm driver does while its job runs: watch both steps, and end, requeue or fail the job.

- training finished (the actor step exits 0 after writing `control/done`): stop the engine pool, end;
- the actor step fails: stop the engine pool and fail the job with its reason (its `error:` line
  when it refused its input), so no node idles on a dead run;
- the engine step (or the sandbox's, with `[sandbox]`) dies: relaunch it in the same allocation, up to
  `slurm.max_engine_restarts` times, while the actor pool keeps its state; past that, the actor
  checkpoints and the job fails;
- a cause recorded for the run (`control/failed`: a circuit breaker, a config error found at run
  time, no step for `run.stall_timeout_s`): the actor checkpoints and the job fails with that line;
  it is never relaunched as if it were a crash;
- a stop: the actor pool checkpoints at the next step boundary (`control/stop`, bounded by
  `slurm.stop_timeout_s`), the pool stops, then what Slurm says the stop was decides (`stop_cause`):
  the time-limit warning (SIGUSR1), a preemption or the time limit → `scontrol requeue`; a requeue Slurm
  is already doing → exit for it; `scancel` or a SIGTERM nothing explains → the job ends, not requeued;
  `control/cancel` (`molt-hpc cancel`) → the job is cancelled.
"""

import subprocess
import sys
import time
from pathlib import Path

from molt_hpc.config import MoltConfig
from molt_hpc.launch.procs import Child
from molt_hpc.launch.slurm.state import control_file, stop_cause, touch_control
from molt_hpc.launch.slurm.steps import PoolSteps
from molt_hpc.launch.watchdog import Watchdog
from molt_hpc.log import get_logger

POLL_S = 0.5
POOL_STOP_S = 15.0
REQUEUED_EXIT = 0
STOP_SIGNALS_TEXT = {
    "warning": "the time-limit warning or a preemption notice",
    "preempted": "a preemption",
    "time limit": "the time limit",
    "requeued": "a requeue by Slurm: a preemption or `scontrol requeue`",
    "cancelled": "`scancel`",
    "signal": "a SIGTERM that no preemption, time limit or requeue explains (sent by hand)",
    "cancel": "`molt-hpc cancel`",
}


class DriverError(RuntimeError):
    """The run cannot go on in this job; the message says why and how to continue."""

    def __init__(self, message: str, config_error: bool = False):
        super().__init__(message)
        self.config_error = config_error


class Lifecycle:
    """The watch loop and what follows it; one instance per job start."""

    def __init__(
        self,
        cfg: MoltConfig,
        run_dir: Path,
        job_id: str,
        actor: Child,
        pool: PoolSteps,
        signals,
        restart: int,
        trackers,
    ):
        self.cfg, self.run_dir, self.job_id, self.restart = cfg, run_dir, job_id, restart
        self.actor, self.pool, self.signals, self.trackers = actor, pool, signals, trackers
        self.watchdog = Watchdog(cfg, run_dir)
        self.log = get_logger()

    def done(self) -> bool:
        return control_file(self.run_dir, "done").exists()

    def resume_hint(self) -> str:
        latest = self.run_dir / "checkpoints" / "latest"
        return f"; continue with: molt-hpc submit --resume {self.run_dir}" if latest.exists() else ""

    def run(self) -> dict[str, object]:
        outcome = self.watch()
        if outcome == "done":
            self.wait_for_final_eval()
            self.pool.stop(POOL_STOP_S)
            self.log.info("training finished; engine pool stopped after %d relaunches", self.pool.restarts)
            self.release_buffer()
            return {"status": "done", "engine_restarts": self.pool.restarts}
        if outcome == "failed":
            self.checkpoint_and_stop_actor()
            self.pool.stop(POOL_STOP_S)
            failure = self.watchdog.check() or {}
            hint = "" if failure.get("config_error") else self.resume_hint()
            raise DriverError(f"run stopped: {failure.get('reason')}{hint}", bool(failure.get("config_error")))
        if outcome == "engines failed":
            self.checkpoint_and_stop_actor()
            raise DriverError(
                f"the engine pool died {self.pool.restarts + 1} times (slurm.max_engine_restarts = "
                f"{self.cfg.slurm.max_engine_restarts}); see {self.pool.log}. The actor pool checkpointed"
                f"{self.resume_hint()}"
            )
        if outcome == "cancel":
            return self.stop_and_leave("control/cancel", "cancel")
        if self.signals.received == "SIGUSR1":
            return self.stop_and_leave("SIGUSR1", "warning")
        what = self.signals.received or f"the {outcome}"  # a step stopped by a signal the driver did not get
        return self.stop_and_leave(what, stop_cause(self.job_id, self.restart))

    def release_buffer(self) -> None:
        """Training finished and both steps stopped: free the run's /dev/shm spool (shm backend)."""
        from molt_hpc.buffer.cleanup import release_finished

        removed = release_finished(self.run_dir)
        if removed is not None:
            self.log.info("removed the finished run's replay buffer %s", removed)

    def wait_for_final_eval(self) -> None:
        """Training is done: with `[eval]`, the orchestrator evaluates the last version before the engines stop."""
        from molt_hpc.launch.local import final_eval_pending

        while final_eval_pending(self.run_dir, self.cfg.eval is not None) and self.pool.poll() is None:
            if self.signals.received or control_file(self.run_dir, "cancel").exists():
                return
            self.trackers.update()
            time.sleep(POLL_S)

    def watch(self) -> str:
        """Poll both steps until: done, signal, cancel, failed, actor/pool stopped, engines failed (or raise)."""
        while True:
            time.sleep(POLL_S)
            self.trackers.update()
            if self.signals.received:
                return "signal"
            if control_file(self.run_dir, "cancel").exists():
                return "cancel"
            if self.watchdog.check() is not None:
                return "failed"
            code = self.actor.poll()
            if code is not None:
                if code == 0:  # the trainer exits 0 when done, or after the checkpoint of a stop it was sent
                    return "done" if self.done() else "actor pool stopped"
                if self.watchdog.check() is not None:  # it failed for a cause recorded meanwhile
                    return "failed"
                self.pool.stop(POOL_STOP_S)
                raise self.actor_failed(code)
            code = self.pool.poll()
            if code is not None and not self.done():
                if self.watchdog.check() is not None:
                    return "failed"
                if code == 0:  # the pool exits 0 only when it was told to stop: a stop, not a death
                    return "engine pool stopped"
                if self.pool.restarts >= self.cfg.slurm.max_engine_restarts:
                    return "engines failed"
                self.pool.restarts += 1
                self.log.warning(
                    "the engine pool step exited with code %s; relaunching it (%d/%d); last lines:\n%s",
                    code, self.pool.restarts, self.cfg.slurm.max_engine_restarts, self.pool.tail(),
                )  # fmt: skip
                self.pool.start()

    def actor_failed(self, code: int) -> DriverError:
        from molt_hpc.launch.local import user_error_line

        refused = user_error_line(self.actor.log) if code == 2 else None
        if refused is not None:
            return DriverError(f"the actor pool refused to start: {refused}", config_error=True)
        return DriverError(
            f"the actor pool step exited with code {code} before training finished{self.resume_hint()}; last "
            f"lines of {self.actor.log}:\n{self.actor.tail()}"
        )

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

    def stop_and_leave(self, what: str, cause: str) -> dict[str, object]:
        """Checkpoint, stop the pool, then requeue, end or cancel the job as `cause` asks."""
        self.log.info("%s: the actor pool checkpoints at the next step boundary (%s)", what, STOP_SIGNALS_TEXT[cause])
        self.checkpoint_and_stop_actor()
        self.pool.stop(POOL_STOP_S)
        if self.done():
            self.log.info("training finished while stopping")
            self.release_buffer()
            return {"status": "done", "engine_restarts": self.pool.restarts}
        if cause == "cancel" or control_file(self.run_dir, "cancel").exists():
            if stop_cause(self.job_id, self.restart) == "cancelled":  # `cancel --now`: Slurm ends it already
                return {"status": "cancelled"}
            return cancel_job(self.job_id)
        if cause in ("warning", "preempted", "time limit") and stop_cause(self.job_id, self.restart) == "cancelled":
            cause = "cancelled"  # cancelled while it checkpointed: a cancel wins
        if cause in ("cancelled", "signal"):
            self.log.info("the job ends after the checkpoint, not requeued%s", self.resume_hint())
            return {"status": "cancelled" if cause == "cancelled" else "stopped"}
        if cause == "requeued":
            self.log.info("Slurm requeues job %s; it resumes from the checkpoint", self.job_id)
            sys.exit(REQUEUED_EXIT)  # SystemExit: submitit writes no result, the requeued job runs it again
        if not self.cfg.slurm.requeue:
            raise DriverError(f"stopped by {STOP_SIGNALS_TEXT[cause]} after a checkpoint; slurm.requeue is off"
                              f"{self.resume_hint()}")  # fmt: skip
        out = subprocess.run(["scontrol", "requeue", self.job_id], capture_output=True, text=True)
        if out.returncode:
            raise DriverError(f"scontrol requeue {self.job_id} failed ({out.stderr.strip()}); the checkpoint is safe"
                              f"{self.resume_hint()}")  # fmt: skip
        self.log.info("requeued job %s; it resumes from the checkpoint", self.job_id)
        sys.exit(REQUEUED_EXIT)


def cancel_job(job_id: str) -> dict[str, object]:
    """End the job as CANCELLED (its steps are already stopped), so Slurm's record says what happened."""
    get_logger().info("cancelling job %s", job_id)
    subprocess.run(["scancel", job_id], capture_output=True)
    return {"status": "cancelled"}
