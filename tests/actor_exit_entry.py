"""One trainer rank cut to its lifecycle: join the gloo world, shard a tiny model with FSDP2, take one
optimizer step, run the loop's collectives on Python-made tensors, then the trainer's own shutdown
(`close_world`, then `end_process`). `tests/test_actor_exit.py` starts two of these, 20 times.

Run as `python tests/actor_exit_entry.py` with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set.
"""

from typing import ClassVar

import torch
from torch import nn

from molt_hpc.actor.world import any_rank, close_world, gather_all, init_world, share, sum_ranks
from molt_hpc.config.train import ActorConfig
from molt_hpc.log import end_process
from molt_hpc.parallel import parallelize


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


if __name__ == "__main__":
    end_process(main())
