"""Requests from outside the trainer, acted on at the next step boundary.

SIGUSR1 or the file `RUN_DIR/control/checkpoint`: checkpoint and continue. SIGTERM or
`RUN_DIR/control/stop`: checkpoint and exit 0. Signals may reach any rank (or all); files are read
by rank 0. `poll` ORs every rank's view so all ranks take the same decision in the same step.
"""

import signal
from dataclasses import dataclass
from pathlib import Path

from molt_hpc.actor.world import any_rank


@dataclass(frozen=True)
class Requests:
    checkpoint: bool = False
    stop: bool = False
    ready: bool = False
    """Rank 0 holds a full batch for the next step."""
    refit: bool = False
    """The registered engines changed (or a refit failed): push the weights now."""


class Control:
    """Signal handlers and control files of one rank."""

    def __init__(self, run_dir: Path, is_main: bool):
        self.dir = Path(run_dir) / "control"
        self.is_main = is_main
        self._signalled = {"checkpoint": False, "stop": False}
        signal.signal(signal.SIGUSR1, lambda *_: self._set("checkpoint"))
        signal.signal(signal.SIGTERM, lambda *_: self._set("stop"))

    def _set(self, what: str) -> None:
        self._signalled[what] = True

    def _file(self, name: str) -> bool:
        return self.is_main and (self.dir / name).exists()

    def poll(self, ready: bool = False, refit: bool = False) -> Requests:
        """What every rank was asked (a collective); `ready` and `refit` are rank 0's view."""
        ck = self._signalled["checkpoint"] or self._file("checkpoint")
        stop = self._signalled["stop"] or self._file("stop")
        ck, stop, ready, refit = any_rank([ck, stop, ready and self.is_main, refit and self.is_main])
        return Requests(checkpoint=ck, stop=stop, ready=ready, refit=refit)

    def served(self, req: Requests) -> None:
        """The requests in `req` were carried out: forget the signals, remove the files."""
        for what, asked in (("checkpoint", req.checkpoint), ("stop", req.stop)):
            if asked:
                self._signalled[what] = False
                if self.is_main:
                    (self.dir / what).unlink(missing_ok=True)

    def mark_done(self) -> None:
        """Tell the launcher training finished (`control/done`)."""
        if self.is_main:
            self.dir.mkdir(parents=True, exist_ok=True)
            (self.dir / "done").touch()
