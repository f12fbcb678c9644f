"""Start N gloo ranks of a test in processes that leave the way the trainer's do.

`torch.multiprocessing.spawn` returns from the rank function into the interpreter's teardown, where
torch's gloo threads (still referenced from C++ once FSDP2 or DTensor used the group) can meet a
finalizing interpreter and abort the process (`terminate called without an active exception`): a
rank whose work passed is then reported as killed by SIGABRT. `spawn_ranks` runs the rank function,
then leaves through `molt_hpc.log.end_process`, as every process kind of the package does. A rank
that raises still fails the test: spawn's wrapper reports its traceback and exit code 1.
"""

from collections.abc import Callable

import torch.multiprocessing as mp


def _rank_then_end(rank: int, fn: Callable, args: tuple) -> None:
    from molt_hpc.log import end_process

    fn(rank, *args)
    end_process(0)


def spawn_ranks(fn: Callable, args: tuple, nprocs: int) -> None:
    """`mp.spawn(fn, args, nprocs)`, each rank ending with exit 0 once `fn` has returned."""
    mp.spawn(_rank_then_end, args=(fn, tuple(args)), nprocs=nprocs, join=True)
