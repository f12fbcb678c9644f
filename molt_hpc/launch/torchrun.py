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


def _loopback_stores() -> None:
    """Make every TCPStore server this agent starts (the rendezvous store, the workers' store) listen
    on 127.0.0.1: torch binds them to every interface whatever address it is given, and nothing of a
    local-mode run may be reachable from the network. A subclass, so torch's isinstance checks hold."""
    import torch.distributed as dist
    from torch.distributed import rendezvous
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend, static_tcp_rendezvous

    from molt_hpc.net import listen_fd

    base = dist.TCPStore

    class LoopbackStore(base):  # type: ignore[misc, valid-type]
        def __init__(self, host_name: str, port: int = 0, *args, **kwargs) -> None:
            is_master = kwargs.get("is_master", args[1] if len(args) > 1 else False)
            if is_master and kwargs.get("master_listen_fd") is None:
                kwargs["master_listen_fd"] = listen_fd(port)
            super().__init__(host_name, port, *args, **kwargs)

    for module in (dist, rendezvous, c10d_rendezvous_backend, static_tcp_rendezvous):
        if getattr(module, "TCPStore", None) is base:
            module.TCPStore = LoopbackStore


def main(argv: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun

    from molt_hpc.net import loopback_only

    if loopback_only():
        _loopback_stores()
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
