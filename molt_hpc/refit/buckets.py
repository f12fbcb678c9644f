"""Tensor metadata and the bucket plan: how named tensors are laid out in flat uint8 broadcast buffers.

Both ends compute the same plan from the same inputs (names, dtypes, shapes in order, bucket size),
so only the metadata travels over HTTP and only bytes travel over the communicator. Each tensor
starts at a 16-byte aligned offset so the receiver can view the bytes as the tensor's dtype.
"""

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

ALIGN = 16
LARGE = 1 << 22
"""Elements from which a tensor gets a copy kernel of its own rather than a place in the multi-tensor copy.
PyTorch's multi-tensor copy moves large tensors well below a plain copy's bandwidth, while a launch per
small tensor costs more than it moves. A 7B model's parameters on an H200 (a plain copy of their bf16
bytes: 7.2 ms): fp32 -> bf16 13.3 ms as one multi-tensor copy, 11.1 ms split here (bf16 -> bf16: 10.8 and
7.7 ms); at 0.5B 1.20 -> 1.16 ms and 1.00 -> 0.88 ms, where a split at 2^16 lost (1.61 ms: the launches)."""


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` → `"bfloat16"` (vLLM's `dtype_names`)."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype name {name!r}; use torch dtype names like 'float32' or 'bfloat16'")
    return dtype


@dataclass(frozen=True)
class TensorMeta:
    """Name, dtype and shape of one tensor of a refit."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> "TensorMeta":
        return cls(name, dtype_name(tensor.dtype), tuple(tensor.shape))

    @property
    def nbytes(self) -> int:
        numel = 1
        for dim in self.shape:
            numel *= dim
        return numel * dtype_from_name(self.dtype).itemsize


@dataclass(frozen=True)
class Bucket:
    """Tensors that travel in one broadcast, with their byte offsets in the flat buffer."""

    metas: tuple[TensorMeta, ...]
    offsets: tuple[int, ...]
    nbytes: int


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def plan_buckets(metas: Sequence[TensorMeta], bucket_bytes: int) -> list[Bucket]:
    """Cut `metas`, in order, into buckets of at most `bucket_bytes` (a larger tensor gets a bucket alone)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    buckets: list[Bucket] = []
    cur: list[TensorMeta] = []
    offsets: list[int] = []
    size = 0
    for meta in metas:
        start = _aligned(size)
        if cur and start + meta.nbytes > bucket_bytes:
            buckets.append(Bucket(tuple(cur), tuple(offsets), size))
            cur, offsets, start = [], [], 0
        cur.append(meta)
        offsets.append(start)
        size = start + meta.nbytes
    if cur:
        buckets.append(Bucket(tuple(cur), tuple(offsets), size))
    return buckets


def bucket_views(buffer: torch.Tensor, bucket: Bucket) -> list[torch.Tensor]:
    """Each tensor of `bucket` as a typed, shaped view into the uint8 `buffer` (no copies)."""
    assert buffer.dtype == torch.uint8 and buffer.numel() >= bucket.nbytes
    return [
        buffer[offset : offset + meta.nbytes].view(dtype_from_name(meta.dtype)).view(meta.shape)
        for meta, offset in zip(bucket.metas, bucket.offsets, strict=True)
    ]


def pack_into(
    buffer: torch.Tensor, bucket: Bucket, tensors: Sequence[torch.Tensor], views: list[torch.Tensor] | None = None
) -> torch.Tensor:
    """Copy `tensors` (matching `bucket.metas` in shape; cast to their dtypes) into the uint8 `buffer`, in
    a few kernels (`copy_tensors`); `views` are `bucket_views(buffer, bucket)` when the caller keeps them.
    Returns the bucket's slice."""
    views = bucket_views(buffer, bucket) if views is None else views
    copy_tensors(views, [t.detach() for t in tensors])
    return buffer[: bucket.nbytes]


@dataclass
class CopyPlan:
    """`into[i].copy_(source[i])` for every i, cast on the way: one kernel per large tensor, one multi-tensor
    copy for the rest. Built once for tensors that stay where they are (the lists are kept)."""

    into: Sequence[torch.Tensor]
    source: Sequence[torch.Tensor]
    large: list[tuple[torch.Tensor, torch.Tensor]] = field(init=False)
    small: tuple[list[torch.Tensor], list[torch.Tensor]] = field(init=False)

    def __post_init__(self) -> None:
        assert len(self.into) == len(self.source), "a copy pairs each target with one source"
        self.large, self.small = [], ([], [])
        for dst, src in zip(self.into, self.source, strict=True):
            if dst.numel() >= LARGE:
                self.large.append((dst, src))
            else:
                self.small[0].append(dst)
                self.small[1].append(src)

    def run(self) -> None:
        for dst, src in self.large:
            dst.copy_(src)
        if self.small[0]:
            torch._foreach_copy_(*self.small)


def copy_tensors(into: Sequence[torch.Tensor], source: Sequence[torch.Tensor]) -> None:
    """Copy each source tensor into its target (same shapes, cast to the target's dtype), see `CopyPlan`."""
    CopyPlan(into, source).run()


def unpack(buffer: torch.Tensor, bucket: Bucket) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, view) of each tensor of `bucket` inside the received uint8 `buffer` (no copies)."""
    yield from zip((m.name for m in bucket.metas), bucket_views(buffer, bucket), strict=True)


def tensor_lists(metas: Sequence[TensorMeta]) -> dict[str, list]:
    """Names, dtype names and shapes in order: the tensor part of vLLM's `update_info`."""
    return {
        "names": [m.name for m in metas],
        "dtype_names": [m.dtype for m in metas],
        "shapes": [list(m.shape) for m in metas],
    }


def update_info(metas: Sequence[TensorMeta], bucket_bytes: int, version: int) -> dict[str, Any]:
    """The `/update_weights` body's `update_info` (vLLM's field names, plus the bucket size)."""
    return {**tensor_lists(metas), "packed": True, "bucket_bytes": bucket_bytes, "version": version}


def metas_from_info(info: dict[str, Any]) -> list[TensorMeta]:
    """Parse `update_info` back into metadata; a malformed one raises `ValueError` naming the field."""
    names, dtypes, shapes = info.get("names"), info.get("dtype_names"), info.get("shapes")
    if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)):
        raise ValueError("update_info needs the lists 'names', 'dtype_names' and 'shapes'")
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError(
            f"update_info lists differ in length: {len(names)} names, {len(dtypes)} dtype_names, {len(shapes)} shapes"
        )
    metas = []
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        if not isinstance(name, str) or not isinstance(shape, list) or not all(isinstance(d, int) for d in shape):
            raise ValueError(f"update_info entry {name!r}: names are strings and shapes are lists of ints")
        dtype_from_name(dtype)
        metas.append(TensorMeta(name, dtype, tuple(shape)))
    return metas
