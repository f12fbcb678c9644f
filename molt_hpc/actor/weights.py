"""Full weights out of the FSDP shards, bucket by bucket, under their HF parameter names.

Both the refit and the checkpoint walk the same plan: buckets of whole tensors up to a byte budget,
in parameter order. Every rank takes part in each gather (it is a collective); only rank 0 keeps the
result, so at most one bucket of full tensors is ever materialised (and expert-parallel experts are
gathered on rank 0 alone).
"""

from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from molt_hpc.parallel.expert_gather import gather_experts, is_expert_sharded


def plan_buckets(model: nn.Module, bucket_bytes: int, dtype: torch.dtype | None = None) -> list[list[str]]:
    """Parameter names cut into buckets of at most `bucket_bytes` (a larger tensor gets its own bucket)."""
    buckets: list[list[str]] = [[]]
    used = 0
    for name, p in model.named_parameters():
        size = p.numel() * (torch.empty((), dtype=dtype or p.dtype).element_size())
        if buckets[-1] and used + size > bucket_bytes:
            buckets.append([])
            used = 0
        buckets[-1].append(name)
        used += size
    return [b for b in buckets if b]


def full_tensor(p: torch.Tensor, dtype: torch.dtype | None = None, device=None) -> tuple[torch.Tensor, bool]:
    """The whole of parameter `p` (gathered from its shards, a collective) at `dtype` if that is narrower,
    and whether the result is a fresh tensor (False: it shares memory with the parameter).

    Expert-parallel experts are whole on rank 0 only (others get an empty tensor), assembled slice by
    slice on `device` (default: the parameter's): see `expert_gather`."""
    if is_expert_sharded(p):
        return gather_experts(p, dtype, device or p.to_local().device), True
    fresh = False
    if isinstance(p, DTensor) and p.device_mesh.size() == 1:
        p = p.to_local()  # a world of one holds the whole tensor: nothing to gather, and plain-tensor ops
    if dtype is not None and dtype.itemsize < p.dtype.itemsize:
        p, fresh = p.to(dtype), True  # cast the shard before gathering: the gather moves fewer bytes
    if isinstance(p, DTensor) and p.to_local().device.type != p.device_mesh.device_type:
        # a shard in host memory (CPU offload) on a GPU mesh: gather over NCCL, not the CPU group
        p, fresh = DTensor.from_local(p.to_local(), p.device_mesh, p.placements, shape=p.shape, stride=p.stride()), True
    if isinstance(p, DTensor):
        p, fresh = p.full_tensor(), True
    return p, fresh


def full_buckets(
    model: nn.Module,
    plan: list[list[str]],
    *,
    keep: bool,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
) -> Iterator[dict[str, torch.Tensor]]:
    """Yield each bucket of `plan` as name → full tensor; empty dicts where `keep` is False.

    Every rank must iterate to the end (each bucket is a collective). A kept tensor never shares memory
    with its parameter.
    """
    params = dict(model.named_parameters())
    for names in plan:
        out = {}
        for name in names:
            full, fresh = full_tensor(params[name].detach(), dtype, device)
            if keep:
                out[name] = full.to(device=device, dtype=dtype or full.dtype, copy=not fresh)
            del full
        yield out


def bucket_count_bytes(model: nn.Module, dtype: torch.dtype | None = None) -> int:
    """Bytes of every parameter at `dtype` (the checkpoint index's total size)."""
    return sum(p.numel() * torch.empty((), dtype=dtype or p.dtype).element_size() for p in model.parameters())
