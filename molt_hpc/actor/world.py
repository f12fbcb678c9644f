"""The actor pool's process group: rank, device, the meshes, and the few collectives the loop needs.

gloo on CPU, NCCL on GPU (with gloo next to it for CPU-side objects), same code. Started by torchrun; a plain
`python jobs/actor.py` (a local run of one rank) is a world of one with its store in-process. The meshes are
built in one place (`actor_meshes`): FSDP shards over every rank; with context parallelism a (dp, cp) grid of
the same ranks, CP innermost so that a CP group is adjacent ranks of one node.
"""

import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from molt_hpc.config.train import ActorConfig
from molt_hpc.log import setup_logging
from molt_hpc.parallel.context import ContextParallel


@dataclass(frozen=True)
class World:
    """This rank's place in the actor pool."""

    rank: int
    size: int
    device: torch.device
    mesh: DeviceMesh
    """FSDP's mesh: every rank."""
    grid: DeviceMesh | None = None
    """The (dp, cp) grid of the same ranks when actor.cp > 1."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def cp(self) -> ContextParallel | None:
        """This rank's CP group, None without context parallelism."""
        if self.grid is None:
            return None
        sub = self.grid["cp"]
        return ContextParallel(group=sub.get_group(), rank=sub.get_local_rank(), size=sub.size())

    @property
    def cp_size(self) -> int:
        return 1 if self.grid is None else self.grid["cp"].size()

    @property
    def cp_rank(self) -> int:
        return self.rank % self.cp_size

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: groups of ranks that train different rows."""
        return self.size // self.cp_size

    @property
    def dp_rank(self) -> int:
        return self.rank // self.cp_size

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        """The ranks holding the same CP slice of different rows (None: every rank)."""
        return None if self.grid is None else self.grid["dp"].get_group()


def pick_device(cfg: ActorConfig, local_rank: int) -> torch.device:
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("actor.device = 'cuda' but no CUDA device is visible; set actor.device = 'cpu' or 'auto'")
    if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()):
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_world(cfg: ActorConfig, timeout_s: float = 1800.0) -> World:
    """Join (or start) the default process group and build the 1-D FSDP mesh over every rank."""
    device = pick_device(cfg, int(os.environ.get("LOCAL_RANK", "0")))
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        timeout = timedelta(seconds=timeout_s)
        if "RANK" in os.environ:  # started by torchrun (or set up as it sets a rank up)
            dist.init_process_group(backend, timeout=timeout)
        else:  # a world of one: its store lives in this process, so no port is opened
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    size = dist.get_world_size()
    mesh, grid = actor_meshes(device.type, size, cfg.cp)
    return World(rank=dist.get_rank(), size=size, device=device, mesh=mesh, grid=grid)


def actor_meshes(device_type: str, size: int, cp: int) -> tuple[DeviceMesh, DeviceMesh | None]:
    """FSDP's 1-D mesh over every rank, and with `cp > 1` the (dp, cp) grid (rank = dp_rank·cp + cp_rank)."""
    if size % cp:
        raise ValueError(
            f"actor.cp = {cp} does not divide the actor pool's {size} ranks: every CP group needs cp ranks; "
            "change actor.cp or the number of trainer ranks"
        )
    mesh = init_device_mesh(device_type, (size,), mesh_dim_names=("fsdp",))
    grid = init_device_mesh(device_type, (size // cp, cp), mesh_dim_names=("dp", "cp")) if cp > 1 else None
    return mesh, grid


def close_world(barrier: bool = True) -> None:
    """Destroy every process group of this rank, after a barrier when all ranks end together.

    A rank that fails skips the barrier (its peers may never reach it) and only tears down its own side.
    """
    if not dist.is_initialized():
        return
    if barrier:
        dist.barrier()
    dist.destroy_process_group()


def run_rank(cfg, make) -> int:
    """This rank's whole life as a trainer: join the world, log with a role prefix, build the trainer with
    `make(world)`, run it; then close the trainer and the world (the barrier only after a clean run)."""
    world = init_world(cfg.actor)
    setup_logging(f"actor r{world.rank}", cfg.logging.level, quiet=not world.is_main and not cfg.logging.all_ranks)
    trainer, clean = None, False
    try:
        trainer = make(world)
        code = trainer.run()
        clean = True
        return code
    finally:
        if trainer is not None:
            trainer.close()
        close_world(barrier=clean)


def any_rank(flags: list[bool]) -> list[bool]:
    """Each flag OR-ed over every rank, so all ranks take the same decision."""
    t = torch.tensor([int(f) for f in flags], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [bool(x) for x in t.tolist()]


def sum_ranks(values: list[float]) -> list[float]:
    """Each value summed over every rank (float64 on the CPU group)."""
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return t.tolist()


def max_over_ranks(value: int) -> int:
    """The largest `value` of any rank (one all-reduce of an int64 on the CPU group, no pickling)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def share(obj: Any, src: int = 0) -> Any:
    """`obj` from rank `src` on every rank."""
    if dist.get_world_size() == 1:  # nothing to send (over NCCL the object would go through the GPU)
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def from_main(fn: Callable[[], Any], world: World) -> Any:
    """`fn()` on rank 0, its result (or its ValueError) on every rank."""
    result, error = None, None
    if world.is_main:
        try:
            result = fn()
        except ValueError as err:  # raised again on every rank, so all stop with the same message
            error = str(err)
    result, error = share((result, error))
    if error is not None:
        raise ValueError(error)
    return result


def gather_all(obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order, on every rank."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out
