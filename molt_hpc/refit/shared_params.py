"""Refit with no copy on the trainer's side: an engine on the trainer's GPU reads its parameters in place.

A trainer rank that holds whole parameters (a world of one: its FSDP shards are the tensors) keeps them
at fixed addresses, since the optimizer updates them in place. It shares their CUDA IPC handles once;
each refit is then a few copy kernels in the engine, from the trainer's parameters straight into
its own, cast on the way. From fp32 master weights that is 6 bytes of memory traffic per parameter
(read 4, write 2) against 4 for a plain copy of the engine's bf16 weights, where packing into shared
slots and copying out (`ipc.py`) moves 10 (cast into the slot 6, copy out 4).

The contract that makes reading live parameters safe: the trainer's device is idle when it posts the
update (it synchronises its stream first), and it does not touch the parameters until every engine
answered the update, which each engine does only after synchronising its own device. The trainer
blocks in the push, so the call order gives both.

    specs = share(named)                      # trainer: JSON fields, one per tensor
    key = addresses(named)                    # trainer: re-share when this changes (a reload)
    tensors = SharedParams(spec_list, uuid)   # engine: mapped and validated field by field
"""

from collections.abc import Sequence
from typing import Any

import torch

from molt_hpc.refit.buckets import CopyPlan, TensorMeta, dtype_from_name, dtype_name
from molt_hpc.refit.handles import cuda_handle, open_cuda_handle

MAX_TENSORS = 1 << 20
"""More names than any model has: a bound on what an init call may ask an engine to map."""


def shareable(named: Sequence[tuple[str, torch.Tensor]]) -> bool:
    """Whether these tensors can be read in place: non-empty, contiguous floating tensors on one GPU."""
    if not named:
        return False
    devices = {t.device for _, t in named}
    return (
        len(devices) == 1
        and next(iter(devices)).type == "cuda"
        and all(t.is_contiguous() and t.numel() > 0 and t.dtype.is_floating_point for _, t in named)
    )


def addresses(named: Sequence[tuple[str, torch.Tensor]]) -> tuple:
    """What the engines' mappings depend on: each tensor's name, address, dtype and shape."""
    return tuple((name, t.data_ptr(), t.dtype, tuple(t.shape)) for name, t in named)


def share(named: Sequence[tuple[str, torch.Tensor]]) -> list[dict[str, Any]]:
    """One JSON record per tensor: its name, dtype, shape and the CUDA IPC handle of its bytes."""
    assert shareable(named), "share() takes what shareable() accepted"
    return [
        {
            "name": name,
            "dtype": dtype_name(t.dtype),
            "shape": list(t.shape),
            "bytes": cuda_handle(t.detach().reshape(-1).view(torch.uint8)),
        }
        for name, t in named
    ]


def _shape(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in value):
        raise ValueError(f"shared parameter {what}: 'shape' must be a list of positive integers, got {value!r}")
    return tuple(value)


def open_one(spec: Any, uuid: str) -> tuple[str, torch.Tensor]:
    """The trainer's tensor described by one record of `share`, mapped into this process."""
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise ValueError("shared parameter: each record needs a 'name' string")
    name = spec["name"]
    dtype = dtype_from_name(str(spec.get("dtype")))
    if not dtype.is_floating_point:
        raise ValueError(f"shared parameter {name}: dtype {dtype} is not a floating type")
    shape = _shape(spec.get("shape"), name)
    handle = spec.get("bytes")
    if not isinstance(handle, dict) or handle.get("kind") != "cuda":
        raise ValueError(f"shared parameter {name}: 'bytes' must be a CUDA IPC handle")
    raw = open_cuda_handle(handle, uuid)
    if raw.numel() != dtype.itemsize * torch.Size(shape).numel():
        raise ValueError(f"shared parameter {name}: {raw.numel()} bytes for a {dtype_name(dtype)} {list(shape)}")
    return name, raw.view(dtype).view(shape)


class SharedParams:
    """An engine's mapping of the trainer's parameters, in the trainer's order."""

    def __init__(self, spec: dict[str, Any]):
        records, uuid = spec.get("params"), spec.get("device_uuid")
        if not isinstance(records, list) or not 0 < len(records) <= MAX_TENSORS:
            raise ValueError("ipc.params must be a non-empty list of shared parameters")
        if not isinstance(uuid, str):
            raise ValueError("ipc.params needs the trainer's 'device_uuid'")
        self.named = [open_one(r, uuid) for r in records]
        self.names = [name for name, _ in self.named]
        self.shapes = [list(t.shape) for _, t in self.named]
        """As an update's `shapes` list writes them: an update in place must name exactly these."""
        self.targets: tuple[dict, CopyPlan] | None = None
        """(the engine's parameters, the copy from the shared tensors into them): set once they were checked."""
        self.nbytes = sum(t.numel() * t.element_size() for _, t in self.named)

    def check(self, names: Sequence[str]) -> None:
        """An update in place names exactly the shared tensors, in order; a `ValueError` otherwise."""
        if list(names) != self.names:
            raise ValueError(
                f"the update names {len(names)} tensors, not the {len(self.names)} shared at init "
                "(the trainer must share its parameters again)"
            )

    def metas(self) -> list[TensorMeta]:
        return [TensorMeta.of(name, t) for name, t in self.named]

    def close(self) -> None:
        self.named, self.names, self.shapes, self.targets = [], [], [], None
