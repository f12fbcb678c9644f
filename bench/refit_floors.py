"""The one-process floors of a refit, for `gpu_refit.py`: what the same bytes cost with no second process
and no protocol (a device copy, the two-pass pack and copy out, the engine's in-place cast, one flat cast).
"""

import statistics

import torch
from gpu_common import timed

from molt_hpc.refit.buckets import TensorMeta, plan_buckets

ROUNDS = 4  # the first is a warm-up


def copy_seconds(nbytes: int, device: torch.device) -> float:
    """Median seconds of one device-to-device copy of `nbytes` (the first round is a warm-up)."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return statistics.median([timed(lambda: dst.copy_(src), device) for _ in range(ROUNDS)][1:])


def pack_and_copy_seconds(model, bucket_mb: int, device: torch.device) -> float:
    """Median seconds of the refit's two passes in one process: pack the fp32 weights into bf16 buckets
    (two slots, alternating), copy each bucket out into bf16 tensors of the engine's shapes."""
    from molt_hpc.refit.buckets import bucket_views, pack_into

    named = [(n, local(p)) for n, p in model.named_parameters()]
    metas = [TensorMeta(n, "bfloat16", tuple(t.shape)) for n, t in named]
    plan = plan_buckets(metas, bucket_mb << 20)
    slots = [torch.empty(max(b.nbytes for b in plan), dtype=torch.uint8, device=device) for _ in range(2)]
    views = [bucket_views(slots[k % 2], b) for k, b in enumerate(plan)]
    dst = {n: torch.empty(t.shape, dtype=torch.bfloat16, device=device) for n, t in named}
    src = dict(named)

    def once() -> None:
        for k, bucket in enumerate(plan):
            pack_into(slots[k % 2], bucket, [src[m.name] for m in bucket.metas], views[k])
            torch._foreach_copy_([dst[m.name] for m in bucket.metas], views[k])

    return statistics.median([timed(once, device) for _ in range(ROUNDS)][1:])


def local(p: torch.Tensor) -> torch.Tensor:
    """A parameter's own tensor (a world of one's FSDP shard is the whole parameter)."""
    return p.detach().to_local() if hasattr(p, "to_local") else p.detach()


def cast_copy_seconds(model, device: torch.device) -> float:
    """Median seconds of the engine's in-place read (`CopyPlan`: the fp32 parameters into bf16 tensors of
    their shapes) in one process, with no second process and no protocol."""
    from molt_hpc.refit.buckets import CopyPlan

    src = [local(p) for p in model.parameters()]
    plan = CopyPlan([torch.empty(t.shape, dtype=torch.bfloat16, device=device) for t in src], src)
    return statistics.median([timed(plan.run, device) for _ in range(ROUNDS)][1:])


def flat_cast_seconds(numel: int, device: torch.device) -> float:
    """Median seconds of one fp32 -> bf16 cast of `numel` contiguous elements: what the memory system allows
    any refit from fp32 master weights, with the tensors laid end to end."""
    src = torch.ones(numel, dtype=torch.float32, device=device)
    dst = torch.empty(numel, dtype=torch.bfloat16, device=device)
    return statistics.median([timed(lambda: dst.copy_(src), device) for _ in range(ROUNDS)][1:])


def one_process_floors(model, device) -> tuple[int, float, float, float, float]:
    """The engine's bf16 bytes and the one-process medians: (bytes, device copy, pack and copy out, the
    in-place parameter copy, one flat cast)."""
    total = sum(p.numel() * 2 for p in model.parameters())
    base = copy_seconds(total, device)
    floor = pack_and_copy_seconds(model, 256, device)
    cast = cast_copy_seconds(model, device)
    flat = flat_cast_seconds(total // 2, device)
    return total, base, floor, cast, flat
