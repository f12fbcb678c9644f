"""The launchers' circuit breaker for what no single process sees: a run that stopped training.

Both launchers (local mode's and the Slurm driver) poll a `Watchdog`. It follows the trainer's step
records in `metrics.jsonl`; when none has come for `run.stall_timeout_s` (counted from the launch,
then from the last step) it records the stall as the run's failure (`molt_hpc.fault`), quoting the
rollout's first failure when the orchestrator reported one. `check()` returns the run's recorded
failure, whoever recorded it (a breaker of the orchestrator, the engine pool, this watchdog).
"""

import json
import time
from pathlib import Path

from molt_hpc.config import MoltConfig
from molt_hpc.fault import fail, read_failure


class Watchdog:
    """Follows one run directory's records from the moment it is made (earlier records do not count)."""

    def __init__(self, cfg: MoltConfig, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        self.stall_s = cfg.run.stall_timeout_s
        self.metrics = self.run_dir / "metrics.jsonl"
        self.offset = self.metrics.stat().st_size if self.metrics.exists() else 0
        self.last_progress = time.monotonic()
        self.first_failure: str | None = None
        """The rollout's first failure, as its records report it."""

    def _follow(self) -> None:
        if not self.metrics.exists():
            return
        with open(self.metrics, "rb") as f:
            f.seek(self.offset)
            chunk = f.read()
        end = chunk.rfind(b"\n") + 1  # a line being written waits for the next look
        self.offset += end
        for line in chunk[:end].splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if rec.get("source") == "actor" and "step" in rec:
                self.last_progress = time.monotonic()
            elif rec.get("source") == "rollout" and rec.get("first_failure") and self.first_failure is None:
                self.first_failure = rec["first_failure"]

    def check(self) -> dict | None:
        """The run's recorded failure (`molt_hpc.fault.read_failure`), after tripping the stall breaker if due."""
        self._follow()
        idle = time.monotonic() - self.last_progress
        if self.stall_s and idle > self.stall_s and read_failure(self.run_dir) is None:
            cause = f"first rollout failure: {self.first_failure}" if self.first_failure else "see logs/rollout.log"
            fail(self.run_dir, f"no training step for {idle:.0f} s (run.stall_timeout_s = {self.stall_s:g}); {cause}",
                 "launcher")  # fmt: skip
        return read_failure(self.run_dir)
