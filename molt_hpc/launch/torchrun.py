"""torchrun for the actor pool, with SIGTERM left to the trainer: `python -m molt_hpc.launch.torchrun ARGS`.

A stop reaches the trainer ranks themselves (Slurm signals every process of a step; local mode, the
child's whole process group), and they answer it with a checkpoint at the next step boundary and exit 0.
Plain torchrun answers the same SIGTERM by raising `SignalException`, killing the ranks it launched
and exiting 1 with a traceback, right after the good checkpoint. Here torchrun does not handle
SIGTERM (`--signals-to-handle` without it); a SIGTERM sent to this process alone is passed on to the
ranks once, and torchrun then ends as its ranks do: 0 after a clean stop, the failure otherwise.
Other signals (SIGINT, SIGHUP, SIGQUIT) keep torchrun's own handling.
"""

import os
import signal
import sys
from pathlib import Path

HANDLED = "SIGINT,SIGHUP,SIGQUIT"


def _children(pid: int) -> list[int]:
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):  # a process that just ended
            continue
        if ppid == pid:
            kids.append(int(stat.parent.name))
    return kids


def _pass_on(signum: int, _frame: object) -> None:
    for pid in _children(os.getpid()):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:  # it ended meanwhile
            continue


def _knows_signal_flag() -> bool:
    """torch ≥ 2.9 lets torchrun choose the signals it handles."""
    from torch.distributed.run import get_args_parser

    return any(a.dest == "signals_to_handle" for a in get_args_parser()._actions)


def main(argv: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun

    signal.signal(signal.SIGTERM, _pass_on)
    if _knows_signal_flag():
        argv = [f"--signals-to-handle={HANDLED}", *argv]
    try:
        torchrun(argv)
    except SignalException as err:  # an older torch handled the signal itself: say so in one line
        print(f"torchrun: stopped by {signal.Signals(err.sigval).name}", file=sys.stderr, flush=True)
        return 128 + int(err.sigval)
    finally:  # the ranks have ended: a late copy of the stop must not kill the exiting interpreter
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
