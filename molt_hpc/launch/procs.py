"""Child processes of a launcher: start with a log file, poll, stop gently then firmly, read the tail.

Every child gets its own process group so a stop reaches its whole tree (torchrun's workers, a
pool's engines) and a Ctrl-C in the terminal reaches only the launcher, which decides what to do
(`StopSignals`).
"""

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from molt_hpc.log import get_logger, log_tail

REPO = Path(__file__).resolve().parents[2]


class StopSignals:
    """A launcher's Ctrl-C / SIGTERM: the first asks the trainer to checkpoint at the next step boundary and
    exit (`control/stop` in the run directory), a second stops at once (`KeyboardInterrupt`)."""

    def __init__(self, run_path: Path):
        self.run_path, self.count = run_path, 0
        self.old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}

    def _on_signal(self, signum, _frame) -> None:
        self.count += 1
        if self.count > 1:
            raise KeyboardInterrupt
        get_logger().info("stopping: the trainer checkpoints at the next step boundary (Ctrl-C again to stop now)")
        (self.run_path / "control" / "stop").touch()

    def restore(self) -> None:
        """Put back the handlers that were there before."""
        for s, handler in self.old.items():
            signal.signal(s, handler)


def job_command(script: str, *args: str) -> list[str]:
    """`python jobs/<script> ARGS` with this interpreter."""
    return [sys.executable, str(REPO / "jobs" / script), *args]


@dataclass
class Child:
    """One supervised child process and the log it writes."""

    name: str
    cmd: list[str]
    log: Path
    env: dict[str, str] = field(default_factory=dict)
    blocked: tuple[signal.Signals, ...] = ()
    """Signals the child starts with blocked: the mask survives exec and its own children inherit it, so a
    signal meant for the launcher (Slurm's warning to an extra pool) cannot end them, even while they start."""
    proc: subprocess.Popen | None = None
    restarts: int = 0

    def start(self) -> "Child":
        self.log.parent.mkdir(parents=True, exist_ok=True)
        # Blocked here for the fork only: one that arrives meanwhile waits, and reaches the launcher after.
        old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, self.blocked)
        try:
            with open(self.log, "ab") as out:
                self.proc = subprocess.Popen(
                    self.cmd,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env={**os.environ, **self.env},
                    cwd=os.getcwd(),
                    start_new_session=True,
                )
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        return self

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def poll(self) -> int | None:
        """Exit code, or None while running."""
        assert self.proc is not None, f"{self.name} was never started"
        return self.proc.poll()

    def wait(self, timeout_s: float) -> int | None:
        """Exit code once it ends within `timeout_s`, else None: a pause that ends as soon as the child does."""
        assert self.proc is not None, f"{self.name} was never started"
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # exited between the poll and the kill
                os.killpg(self.proc.pid, sig)

    def stop(self, grace_s: float = 10.0) -> int | None:
        """SIGTERM the child's group, wait up to `grace_s`, then SIGKILL it."""
        if self.proc is None:
            return None
        self.signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            return self.proc.wait()

    def tail(self, lines: int = 20) -> str:
        return log_tail(self.log, lines)


def stop_all(
    children: list["Child"], grace_s: float = 10.0, meanwhile: Callable[[], None] | None = None
) -> dict[str, int | None]:
    """Stop children in reverse start order, all within about `grace_s` in total; each one's exit code.

    A child stopped by SIGTERM exits 0 after its own ordered shutdown; one still running after the
    grace period is killed (exit -9); one never started has no code. `meanwhile` runs between the
    signals and the waits, while the children shut down (a launcher's end-of-run summary and plot).
    """
    for child in reversed(children):
        child.signal(signal.SIGTERM)
    try:
        if meanwhile is not None:
            meanwhile()
    finally:
        codes = _wait_all(children, grace_s)
    return codes


def _wait_all(children: list["Child"], grace_s: float) -> dict[str, int | None]:
    deadline = time.monotonic() + grace_s
    codes: dict[str, int | None] = {}
    for child in reversed(children):
        if child.proc is None:
            codes[child.name] = None
            continue
        try:
            codes[child.name] = child.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.signal(signal.SIGKILL)
            codes[child.name] = child.proc.wait()
    return codes


def exit_report(codes: dict[str, int | None]) -> str:
    """`engine 0 exit 0, router exit 0, ...` for a log line (children that never started are left out)."""
    return ", ".join(f"{name} exit {code}" for name, code in codes.items() if code is not None)
