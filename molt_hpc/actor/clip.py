"""Global gradient-norm clipping over FSDP2's sharded gradients, on the local shards.

`torch.nn.utils.clip_grad_norm_` on DTensor gradients dispatches every per-tensor op through DTensor
(sharding propagation in Python, a few hundred parameters each step) and reduces the partial norms
once per tensor group. Every FSDP2 gradient is `Shard(0)` over one mesh, so the squared norm of the
whole gradient is the sum over ranks of the squared norms of the local shards: one `_foreach_norm`
over the local tensors, one all-reduce, one `_foreach_mul_`. Gradients of any other layout (replicated,
several meshes, plain tensors next to DTensors) take torch's function, which handles them all.
"""

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Shard


def _local_shards(grads: list[Tensor]) -> tuple[list[Tensor], dist.ProcessGroup | None] | None:
    """The local shards and their mesh's group when every gradient is a Shard(0) DTensor of one 1-D mesh."""
    if not grads or not all(isinstance(g, DTensor) for g in grads):
        return None
    mesh = grads[0].device_mesh
    if mesh.ndim != 1 or any(g.device_mesh != mesh or tuple(g.placements) != (Shard(0),) for g in grads):
        return None
    shards = [g.to_local() for g in grads]
    if any(s.device.type != mesh.device_type for s in shards):  # offloaded to the host: torch's path
        return None
    return shards, mesh.get_group()


@torch.no_grad()
def clip_grad_norm(params: list[Tensor], max_norm: float) -> float:
    """Clip the gradients of `params` to a global L2 norm of `max_norm`; returns the norm before clipping
    (the same on every rank)."""
    grads = [p.grad for p in params if p.grad is not None]
    local = _local_shards(grads)
    if local is None:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    shards, group = local
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for s in shards:
        by_dtype.setdefault(s.dtype, []).append(s)
    device = shards[0].device
    squares = torch.zeros((), dtype=torch.float32, device=device)
    for same in by_dtype.values():
        norms = torch._foreach_norm(same, 2.0)
        squares += torch.stack(norms).float().square().sum()
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(squares, group=group)
    total = squares.sqrt()
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for same in by_dtype.values():
        torch._foreach_mul_(same, coef.to(same[0].dtype))
    return float(total)
