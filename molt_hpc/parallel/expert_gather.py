"""Expert-parallel weights out of their shards for refits and checkpoints, one EP slice at a time.

An expert parameter under EP is a DTensor on the `(efsdp, ep)` mesh. Each rank first gathers its own
EP slice (`E/ep` experts) over `efsdp` (`ep_slice`), which is what FSDP unshards to compute anyway; then the ranks
of rank 0's EP group hand rank 0 their slices one after the other, point to point. No rank other
than rank 0 ever holds more than its slice, and rank 0 holds one incoming slice at a time on the
device: a checkpoint assembles the whole tensor on the CPU, a refit sends it expert by expert under
per-expert HF names (`molt_hpc.refit.experts`).
"""

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from molt_hpc.refit.buckets import TensorMeta, dtype_name
from molt_hpc.refit.experts import expert_pieces, splittable


def is_expert_sharded(p: torch.Tensor) -> bool:
    """Whether `p` is an expert parameter that `apply_expert_parallel` sharded (a DTensor on `(efsdp, ep)`)."""
    return isinstance(p, DTensor) and p.device_mesh.mesh_dim_names == ("efsdp", "ep")


def expert_slices(p: DTensor, dtype: torch.dtype | None = None) -> Iterator[tuple[int, torch.Tensor]]:
    """On rank 0: (first expert, `[E/ep, ...]` slice) for each EP rank's slice of `p`, in expert order.
    Every rank must iterate to the end (collectives); the others yield nothing."""
    mesh = p.device_mesh
    mine = ep_slice(p, dtype)
    if mesh.get_local_rank("efsdp") != 0:
        return
    me, per = mesh.get_local_rank("ep"), mine.shape[0]
    for j in range(mesh["ep"].size()):
        peer = int(mesh.mesh[0, j])  # row-major mesh: rank 0's EP group is its first row
        if dist.get_rank() == 0:
            part = mine
            if j:
                part = torch.empty_like(mine)
                dist.recv(part, src=peer)
            yield j * per, part
        elif me == j:
            dist.send(mine, dst=0)


def ep_slice(p: DTensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """This rank's EP slice of `p` (`[E/ep, ...]`), all-gathered over `efsdp` (a collective of that group).

    FSDP2 cuts the slice along dim 0 as `torch.chunk` does (`ceil(E/ep / efsdp)` rows per rank, the
    last ranks short or empty); gathering the padded chunks by hand keeps this independent of which
    `_StridedShard` redistributions a torch version supports."""
    local = p.to_local()
    if dtype is not None and dtype.itemsize < local.dtype.itemsize:
        local = local.to(dtype)  # cast before moving: fewer bytes
    mesh, ep = p.device_mesh, p.device_mesh["ep"].size()
    n, rows = mesh["efsdp"].size(), p.shape[0] // ep
    if n == 1:
        return local.contiguous()
    chunk = -(-rows // n)
    padded = local.new_zeros((chunk, *local.shape[1:]))
    padded[: local.shape[0]].copy_(local)
    out = local.new_empty((n * chunk, *local.shape[1:]))
    dist.all_gather_into_tensor(out, padded, group=mesh["efsdp"].get_group())
    return out[:rows]


def gather_experts(p: DTensor, dtype: torch.dtype | None = None, device="cpu") -> torch.Tensor:
    """The whole expert parameter `p` on rank 0, assembled on `device` (a collective of every rank);
    other ranks get an empty tensor."""
    out = None
    for start, part in expert_slices(p, dtype):
        if out is None:
            out = torch.empty((p.shape[0], *part.shape[1:]), dtype=part.dtype, device=device)
        out[start : start + part.shape[0]].copy_(part)
    return out if out is not None else torch.empty(0, dtype=dtype or p.dtype)


def refit_split(model: nn.Module) -> set[str]:
    """Names of the EP-sharded parameters that go out per expert."""
    names = set()
    for mod_name, m in model.named_modules():
        if splittable(m):
            for leaf, p in m.named_parameters(recurse=False):
                if is_expert_sharded(p):
                    names.add(f"{mod_name}.{leaf}")
    return names


def refit_metas(model: nn.Module, dtype: torch.dtype, split: set[str] | None = None) -> list[TensorMeta]:
    """What a refit of `model` sends, in order: whole parameters, EP experts per expert (`split`: the
    EP-sharded names, `refit_split(model)` when not given)."""
    split, metas = refit_split(model) if split is None else split, []
    for name, p in model.named_parameters():
        if name not in split:
            metas.append(TensorMeta(name, dtype_name(dtype), tuple(p.shape)))
            continue
        one = torch.empty(p.shape[1:], device="meta")
        for e in range(p.shape[0]):
            metas += [TensorMeta(n, dtype_name(dtype), tuple(t.shape)) for n, t in expert_pieces(name, e, one)]
    return metas


def refit_tensors(
    model: nn.Module, dtype: torch.dtype | None, whole, split: set[str] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) in `refit_metas` order on rank 0 (a collective: every rank iterates to the end);
    `whole(p, dtype)` gathers a parameter that is not split."""
    split = refit_split(model) if split is None else split
    for name, p in model.named_parameters():
        if name not in split:  # (under no_grad a DTensor's detach is one more dispatch per tensor, for nothing)
            yield name, whole(p if not torch.is_grad_enabled() else p.detach(), dtype)
            continue
        for start, part in expert_slices(p.detach(), dtype):
            for i in range(part.shape[0]):
                yield from expert_pieces(name, start + i, part[i])
