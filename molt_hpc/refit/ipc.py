"""Refit through shared memory, for engines on the trainer's own GPU (CUDA IPC) or host (/dev/shm).

NCCL refuses two ranks on one GPU, and a broadcast between two processes of one host copies the bytes
twice for nothing. Here the trainer shares its packed bucket buffers ("slots") once, when it forms the
refit group: CUDA IPC handles of its GPU buffers (`torch.multiprocessing.reductions.reduce_tensor`,
rebuilt by the engine with `rebuild_cuda_tensor`) or, on the CPU, buffers mapped from files in
/dev/shm. The handles travel as plain JSON fields in the token-checked `/init_weight_transfer_engine`
call and are validated field by field on arrival: nothing is unpickled.

Each update then goes as on the broadcast path (init → start → update → finish, the same bucket plan
and versions): the trainer packs bucket g into slot g % slots, waits for its device, and counts it
posted; each engine copies that bucket from the slot into its parameters, waits for its device, and
counts it consumed; the trainer reuses a slot once every engine consumed what it held. The counters
live in a small control file in /dev/shm, read and written with pread/pwrite (system calls order the
memory accesses on any CPU). The trainer holds an exclusive `flock` on that file for the channel's
life, so an engine waiting for a bucket notices a trainer that died (the lock is free) instead of
waiting out the timeout; an engine that dies fails its HTTP call, which the trainer checks while it
waits. `IpcChannel` is the trainer's side, `IpcInbox` the engine's; `handles.py` says who shares
what and turns buffers into JSON fields.
"""

import contextlib
import fcntl
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from molt_hpc.refit.buckets import bucket_views
from molt_hpc.refit.handles import (
    as_count,
    checked_shm_path,
    cuda_handle,
    device_uuid,
    open_cuda_handle,
    open_shm_handle,
    shm_file,
    shm_handle,
)

MAGIC = 0x6D6F6C74_72656669  # "moltrefi"
WORD = 8
ABORT, POSTED, CONSUMED = 1, 2, 3
"""Control-file words: 0 magic, 1 abort flag, 2 buckets posted, 3 + i buckets consumed by engine i."""
POLL_MIN_S, POLL_MAX_S = 50e-6, 2e-3
LIVENESS_S = 0.5


class ChannelClosed(RuntimeError):
    """The other side of the channel is gone, or aborted the update."""


# -- the control file -------------------------------------------------------------------------------


class Control:
    """The counters both sides share: `words` int64 in a /dev/shm file, one pread/pwrite each."""

    def __init__(self, fd: int, words: int):
        self.fd, self.words = fd, words

    def get(self, i: int) -> int:
        return int.from_bytes(os.pread(self.fd, WORD, i * WORD), "little", signed=True)

    def set(self, i: int, value: int) -> None:
        os.pwrite(self.fd, value.to_bytes(WORD, "little", signed=True), i * WORD)

    def close(self) -> None:
        with contextlib.suppress(OSError):  # already closed
            os.close(self.fd)


def wait_until(cond: Callable[[], bool], timeout_s: float, what: str, check: Callable[[], None] | None = None) -> None:
    """Poll `cond` (sleeping 50 µs growing to 2 ms) until true; `check` runs between polls and raises to
    stop early; `TimeoutError` naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    pause = POLL_MIN_S
    while not cond():
        if check is not None:
            check()
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not happen within refit.timeout_s = {timeout_s:.0f}s")
        time.sleep(pause)
        pause = min(2 * pause, POLL_MAX_S)


# -- the trainer's side -----------------------------------------------------------------------------


class IpcChannel:
    """The trainer's shared slots and control file for `consumers` engines (engine i counts into word 3 + i)."""

    def __init__(self, device: torch.device, slot_bytes: int, consumers: int, timeout_s: float, slots: int = 2):
        assert consumers > 0 and slots > 0
        self.device, self.slot_bytes, self.consumers, self.timeout_s = device, slot_bytes, consumers, timeout_s
        self.posted = 0
        self.views: dict[tuple[int, Any], list[torch.Tensor]] = {}
        """Typed views of each (slot, bucket), kept with the slots."""
        self._files: list[Path] = []
        ctl = shm_file(WORD * (CONSUMED + consumers))
        self._files.append(ctl)
        fd = os.open(ctl, os.O_RDWR)
        fcntl.flock(fd, fcntl.LOCK_EX)  # held while the channel lives: engines see a dead trainer by it
        self.control = Control(fd, CONSUMED + consumers)
        self.control.set(0, MAGIC)
        if device.type == "cuda":
            self.uuid = device_uuid(device)
            self.buffers = [torch.empty(slot_bytes, dtype=torch.uint8, device=device) for _ in range(slots)]
            self._handles = [cuda_handle(b) for b in self.buffers]
        else:
            self.uuid = None
            paths = [shm_file(slot_bytes) for _ in range(slots)]
            self._files += paths
            self.buffers = [torch.from_file(str(p), shared=True, size=slot_bytes, dtype=torch.uint8) for p in paths]
            self._handles = [shm_handle(p, slot_bytes) for p in paths]

    def init_info(self, consumer: int) -> dict[str, Any]:
        """What engine `consumer` needs to map the slots (the `ipc` field of its init_info)."""
        return {
            "consumer": consumer,
            "consumers": self.consumers,
            "control": str(self._files[0]),
            "slots": self._handles,
            "device_uuid": self.uuid,
        }

    def unlink(self) -> None:
        """Remove the /dev/shm names once every engine mapped them (the memory lives on while mapped)."""
        for path in self._files:
            with contextlib.suppress(FileNotFoundError):  # already removed
                path.unlink()
        self._files = self._files[:0]

    def slot(self, g: int) -> torch.Tensor:
        return self.buffers[g % len(self.buffers)]

    def wait_free(self, g: int, check: Callable[[], None]) -> None:
        """Block until every engine consumed the bucket that last used bucket g's slot."""
        need = g - len(self.buffers) + 1
        if need <= 0:
            return
        words = range(CONSUMED, CONSUMED + self.consumers)
        wait_until(lambda: all(self.control.get(w) >= need for w in words), self.timeout_s,
                   f"the engines' copy of refit bucket {need - 1}", check)  # fmt: skip

    def post(self, g: int) -> None:
        """Bucket g is packed in its slot: wait for the device, then let the engines copy it."""
        assert g == self.posted, "buckets are posted in order"
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        self.posted = g + 1
        self.control.set(POSTED, self.posted)

    def abort(self) -> None:
        """Make engines waiting for a bucket fail now (a failed push)."""
        self.control.set(ABORT, 1)

    def close(self) -> None:
        self.abort()
        self.unlink()
        self.control.close()  # releases the lock
        self.buffers, self.views = [], {}
        if self.device.type == "cuda":
            torch.cuda.ipc_collect()


class SlotWriter:
    """Feeds tensors one by one into `channel`'s slots along `plan`, posting each bucket once it is
    full: for a sender whose tensors also stream to another consumer (vLLM's NCCL packer)."""

    def __init__(self, channel: IpcChannel, plan: list, check: Callable[[], None]):
        assert all(b.nbytes <= channel.slot_bytes for b in plan), "grow the slots before writing"
        self.channel, self.plan, self.check = channel, plan, check
        self.first, self.bucket, self.index = channel.posted, 0, 0
        self._views: list[torch.Tensor] = []

    def add(self, tensor: torch.Tensor) -> None:
        """Copy the next tensor of the plan (cast to its announced dtype) into its slot."""
        bucket, g = self.plan[self.bucket], self.first + self.bucket
        if self.index == 0:
            self.channel.wait_free(g, self.check)
            key = (g % len(self.channel.buffers), bucket)
            if key not in self.channel.views:
                self.channel.views[key] = bucket_views(self.channel.slot(g), bucket)
            self._views = self.channel.views[key]
        self._views[self.index].copy_(tensor.detach())
        self.index += 1
        if self.index == len(bucket.metas):
            self.check()
            self.channel.post(g)
            self.bucket, self.index = self.bucket + 1, 0

    def done(self) -> bool:
        return self.bucket == len(self.plan)


# -- the engine's side ------------------------------------------------------------------------------


def _open_slots(slots: list[dict[str, Any]], uuid: Any) -> list[torch.Tensor]:
    kinds = {s.get("kind") for s in slots}
    if kinds == {"cuda"}:
        if not isinstance(uuid, str):
            raise ValueError("ipc: CUDA slots need the trainer's 'device_uuid'")
        return [open_cuda_handle(s, uuid) for s in slots]
    if kinds == {"shm"}:
        return [open_shm_handle(s) for s in slots]
    raise ValueError(f"ipc: slots must all be 'cuda' or all 'shm', got {sorted(map(str, kinds))}")


class IpcInbox:
    """One engine's view of the trainer's slots and its own consumed counter."""

    def __init__(self, spec: dict[str, Any], timeout_s: float):
        consumer, consumers = as_count(spec, "consumer"), as_count(spec, "consumers")
        if consumer >= consumers:
            raise ValueError(f"ipc: consumer {consumer} of {consumers}")
        slots = spec.get("slots")
        if not isinstance(slots, list) or not slots or not all(isinstance(s, dict) for s in slots):
            raise ValueError("ipc: 'slots' must be a non-empty list of handles")
        path = checked_shm_path(spec.get("control"))
        fd = os.open(path, os.O_RDWR)
        self.control = Control(fd, CONSUMED + consumers)
        if self.control.get(0) != MAGIC:
            self.control.close()
            raise ValueError(f"ipc: {path} is not a refit control file")
        self.word = CONSUMED + consumer
        self.timeout_s = timeout_s
        try:
            self.buffers = _open_slots(slots, spec.get("device_uuid"))
        except BaseException:
            self.control.close()
            raise
        self._last_alive = time.monotonic()
        self.replaced = False
        """Set when a new init replaced this inbox: a receive still waiting on it stops."""
        self.views: dict[tuple[int, Any], list[torch.Tensor]] = {}
        """Typed views of each (slot, bucket), kept while the slots are mapped."""

    def slot(self, g: int) -> torch.Tensor:
        return self.buffers[g % len(self.buffers)]

    def _check(self) -> None:
        if self.replaced:
            raise ChannelClosed("a new refit channel replaced this one")
        if self.control.get(ABORT):
            raise ChannelClosed("the trainer aborted this refit")
        now = time.monotonic()
        if now - self._last_alive < LIVENESS_S:
            return
        self._last_alive = now
        try:  # the trainer holds LOCK_EX while it lives: getting the lock means it is gone
            fcntl.flock(self.control.fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return
        fcntl.flock(self.control.fd, fcntl.LOCK_UN)
        raise ChannelClosed("the trainer's refit channel is closed (the trainer exited or re-formed the group)")

    def wait_posted(self, g: int) -> None:
        wait_until(lambda: self.control.get(POSTED) > g, self.timeout_s, f"refit bucket {g}", self._check)

    def consumed(self, g: int) -> None:
        """Bucket g is copied out of its slot (the device has finished reading it)."""
        if self.buffers[0].is_cuda:
            torch.cuda.current_stream(self.buffers[0].device).synchronize()
        self.control.set(self.word, g + 1)

    def close(self) -> None:
        self.buffers, self.views = [], {}
        self.control.close()
