"""One trainer rank cut to its lifecycle: join the gloo world, shard a tiny model with FSDP2, take one
optimizer step, run the loop's collectives on Python-made tensors, then the trainer's own shutdown
(`close_world`, then `end_process`). `tests/test_actor_exit.py` runs two of these, 20 times.

`python tests/actor_exit_entry.py ATTEMPTS LOG_DIR` pays the imports once, then for each attempt forks
two children from this process, each a rank set up as torchrun sets one up (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT; rank 0 hosts the store), and prints one line per attempt: the two exit codes
(negative: the signal that ended it). Each child makes its own gloo threads after the fork (this
process never joins a world), so its shutdown is the trainer's, from a fresh process's state.
"""

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn

from molt_hpc.actor.world import any_rank, close_world, gather_all, init_world, share, sum_ranks
from molt_hpc.config.train import ActorConfig
from molt_hpc.log import end_process
from molt_hpc.net import free_port
from molt_hpc.parallel import parallelize

CHILD_TIMEOUT_S = 180.0


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x))


class Tiny(nn.Module):
    _no_split_modules: ClassVar[list[str]] = ["Block"]

    def __init__(self, width: int = 8, depth: int = 2):
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def main() -> int:
    cfg = ActorConfig()
    world = init_world(cfg, timeout_s=120)
    torch.manual_seed(0)
    model = parallelize(Tiny(), world.mesh, cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(world.rank))
    model(x).pow(2).mean().backward()
    opt.step()
    # The loop's own collectives, each on tensors made in Python and dropped right after.
    assert any_rank([world.rank == 1]) == [True]
    assert sum_ranks([1.0]) == [float(world.size)]
    assert share({"step": 1} if world.is_main else None) == {"step": 1}
    assert gather_all(world.rank) == list(range(world.size))
    close_world()
    return 0


def rank_child(rank: int, port: int, log: Path) -> None:
    """In a forked child: output to `log`, the rank's environment, the rank's life, then leave."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    env = {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": 2, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    os.environ.update({k: str(v) for k, v in env.items()})
    try:
        code = main()
    except BaseException:  # the log says why; the parent sees exit code 1
        traceback.print_exc()
        code = 1
    try:
        end_process(code)
    finally:  # end_process never returns; if it ever did, the child must not go on as the parent
        os._exit(98)


def wait_child(pid: int, deadline: float) -> int:
    """The child's exit code (negative: its signal); killed with SIGKILL past the deadline."""
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, 9)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def attempts(count: int, log_dir: Path) -> None:
    for attempt in range(count):
        port = free_port("127.0.0.1")
        sys.stdout.flush()  # nothing buffered is written twice by the children
        pids = []
        for rank in range(2):
            pid = os.fork()
            if pid == 0:
                rank_child(rank, port, log_dir / f"run{attempt}-rank{rank}.log")
            pids.append(pid)
        deadline = time.monotonic() + CHILD_TIMEOUT_S
        print(json.dumps({"attempt": attempt, "codes": [wait_child(pid, deadline) for pid in pids]}), flush=True)


if __name__ == "__main__":
    attempts(int(sys.argv[1]), Path(sys.argv[2]))
