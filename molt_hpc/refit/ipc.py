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
waits. `IpcChannel` is the trainer's side, `IpcInbox` the engine's; `place()` and `colocated()` say
who shares what.
"""

import base64
import binascii
import contextlib
import fcntl
import os
import socket
import stat
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

SHM_DIR = Path("/dev/shm")
PREFIX = "molt-refit-"
MAGIC = 0x6D6F6C74_72656669  # "moltrefi"
WORD = 8
ABORT, POSTED, CONSUMED = 1, 2, 3
"""Control-file words: 0 magic, 1 abort flag, 2 buckets posted, 3 + i buckets consumed by engine i."""
CUDA_HANDLE_BYTES = 64  # cudaIpcMemHandle_t / cudaIpcEventHandle_t
POLL_MIN_S, POLL_MAX_S = 50e-6, 2e-3
LIVENESS_S = 0.5
CPU_AUTO = "ipc"
"""`refit.backend = "auto"` between a CPU trainer and an engine on its host: `ipc` (bench/refit.py, 126 MB
fp32 on 2 cores: 0.04-0.06 s against 0.24-0.36 s over gloo, 256 MiB buckets) or `gloo`."""


class ChannelClosed(RuntimeError):
    """The other side of the channel is gone, or aborted the update."""


# -- who shares what ------------------------------------------------------------------------------


def host_id() -> str:
    """This machine: hostname and boot id (two containers of one host share the boot id, not the name)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:  # not Linux: the hostname alone
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def device_uuid(device: torch.device) -> str:
    """The physical GPU behind `device` (the same in every process, whatever CUDA_VISIBLE_DEVICES says)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return str(torch.cuda.get_device_properties(index).uuid)


def place(device: torch.device) -> dict[str, Any]:
    """Where a process's tensors live, as an engine reports it in `/health` and a sender compares it."""
    uuids = [device_uuid(device)] if device.type == "cuda" else []
    return {"host_id": host_id(), "device_uuids": uuids}


def colocated(mine: dict[str, Any], theirs: dict[str, Any]) -> bool:
    """Whether an engine at `theirs` can map this process's buffers: the same GPU for CUDA tensors, the
    same host (and /dev/shm) for host tensors."""
    if mine.get("device_uuids"):
        return bool(set(mine["device_uuids"]) & set(theirs.get("device_uuids") or []))
    return mine.get("host_id") == theirs.get("host_id") and SHM_DIR.is_dir()


def shm_room(nbytes: int) -> bool:
    """Whether /dev/shm has `nbytes` free (a container's is often 64 MiB)."""
    try:
        free = os.statvfs(SHM_DIR)
    except OSError:  # no /dev/shm
        return False
    return free.f_bavail * free.f_frsize >= nbytes


def choose_transports(
    setting: str,
    group_backend: str,
    mine: dict[str, Any],
    places: list[dict[str, Any] | None],
    urls: list[str],
    slot_bytes: int,
) -> list[str]:
    """Each engine's transport, `ipc` or `group_backend`, for `refit.backend = setting`: `auto` takes
    shared memory for an engine on this trainer's GPU, and on its host when `CPU_AUTO` says so and
    /dev/shm has room for two slots of `slot_bytes`; `ipc` requires it for every engine; `gloo`/`nccl`
    never use it. A choice that cannot work is a `ValueError` naming the fix (NCCL between two ranks of
    one GPU, shared memory across machines)."""
    host_ok = CPU_AUTO == "ipc" and shm_room(2 * slot_bytes + (16 << 20))
    out = []
    for url, theirs in zip(urls, places, strict=True):
        shared = theirs is not None and colocated(mine, theirs)
        on_my_gpu = shared and bool(mine.get("device_uuids"))
        if setting == "ipc" and not shared:
            what = f"GPU {mine['device_uuids'][0]}" if mine.get("device_uuids") else f"host {mine.get('host_id')}"
            raise ValueError(
                f"refit.backend = 'ipc' but engine {url} is not on this trainer's {what}: "
                "set refit.backend = 'auto' (NCCL or gloo to engines elsewhere)"
            )
        if setting == "ipc" or (setting == "auto" and shared and (on_my_gpu or host_ok)):
            out.append("ipc")
            continue
        if group_backend == "nccl" and on_my_gpu:
            raise ValueError(
                f"refit.backend = 'nccl' but engine {url} runs on this trainer's GPU {mine['device_uuids'][0]}: NCCL "
                "refuses two ranks on one GPU; set refit.backend = 'auto' (CUDA IPC to it) or give it its own GPU"
            )
        out.append(group_backend)
    return out


def local_cuda_index(uuid: str) -> int:
    """This process's index of the GPU with `uuid`; a `ValueError` when it does not see that GPU."""
    for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
        if str(torch.cuda.get_device_properties(i).uuid) == uuid:
            return i
    raise ValueError(f"this engine does not see GPU {uuid}, which holds the trainer's refit buffers")


# -- handles: tensors as JSON fields ----------------------------------------------------------------


def _b64(raw: bytes | None) -> str | None:
    return None if raw is None else base64.b64encode(raw).decode()


def _unb64(value: Any, what: str, size: int | None = None) -> bytes:
    if not isinstance(value, str):
        raise ValueError(f"ipc {what}: expected base64 text")
    try:
        raw = base64.b64decode(value, validate=True)
    except binascii.Error:
        raise ValueError(f"ipc {what}: not base64") from None
    if size is not None and len(raw) != size:
        raise ValueError(f"ipc {what}: {len(raw)} bytes, expected {size}")
    return raw


def _int(spec: dict[str, Any], key: str) -> int:
    value = spec.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"ipc handle field {key!r} must be a non-negative integer, got {value!r}")
    return value


def cuda_handle(buffer: torch.Tensor) -> dict[str, Any]:
    """The CUDA IPC handle of a contiguous uint8 GPU buffer, as JSON fields."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

    assert buffer.is_cuda and buffer.dtype == torch.uint8 and buffer.dim() == 1 and buffer.is_contiguous()
    rebuild, args = reduce_tensor(buffer)
    assert rebuild is rebuild_cuda_tensor, "reduce_tensor of a GPU tensor rebuilds with rebuild_cuda_tensor"
    (_cls, _size, _stride, offset, storage_cls, _dtype, _dev, handle, storage_bytes, storage_offset, _grad,
     counter, counter_offset, event, event_sync) = args  # fmt: skip
    return {
        "kind": "cuda",
        "nbytes": buffer.numel(),
        "offset": offset,
        "storage": storage_cls.__name__,
        "handle": _b64(handle),
        "storage_bytes": storage_bytes,
        "storage_offset": storage_offset,
        "ref_counter": _b64(counter),
        "ref_counter_offset": counter_offset,
        "event": _b64(event),
        "event_sync": bool(event_sync),
    }


def open_cuda_handle(spec: dict[str, Any], uuid: str) -> torch.Tensor:
    """The trainer's GPU buffer described by `spec` (from `cuda_handle`), mapped into this process."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    storages = {"TypedStorage": torch.storage.TypedStorage, "UntypedStorage": torch.UntypedStorage}
    if spec.get("storage") not in storages:
        raise ValueError(f"ipc handle: unknown storage kind {spec.get('storage')!r}")
    nbytes, offset = _int(spec, "nbytes"), _int(spec, "offset")
    storage_bytes = _int(spec, "storage_bytes")
    if offset + nbytes > storage_bytes:
        raise ValueError("ipc handle: the buffer does not fit in its storage")
    event = spec.get("event")
    return rebuild_cuda_tensor(
        torch.Tensor, torch.Size([nbytes]), (1,), offset, storages[spec["storage"]], torch.uint8,
        local_cuda_index(uuid), _unb64(spec.get("handle"), "handle", CUDA_HANDLE_BYTES), storage_bytes,
        _int(spec, "storage_offset"), False, _unb64(spec.get("ref_counter"), "ref_counter"),
        _int(spec, "ref_counter_offset"), None if event is None else _unb64(event, "event", CUDA_HANDLE_BYTES),
        bool(spec.get("event_sync")),
    )  # fmt: skip


def shm_file(nbytes: int) -> Path:
    """A new private (0600) file of `nbytes` in /dev/shm, its pages reserved now: a full /dev/shm fails
    here with a clear error, not with SIGBUS at the first write."""
    if not SHM_DIR.is_dir():
        raise ValueError(f"{SHM_DIR} does not exist: shared-memory refit needs Linux; set refit.backend = 'gloo'")
    fd, name = tempfile.mkstemp(prefix=PREFIX, dir=SHM_DIR)
    try:
        os.posix_fallocate(fd, 0, max(nbytes, 1))
    except OSError as err:
        os.close(fd)
        os.unlink(name)
        free = os.statvfs(SHM_DIR)
        raise ValueError(
            f"cannot reserve {nbytes / 2**20:.0f} MiB in {SHM_DIR} ({free.f_bavail * free.f_frsize / 2**20:.0f} MiB "
            f"free): {err}; lower refit.bucket_mb, enlarge /dev/shm (docker: --shm-size) or set refit.backend = 'gloo'"
        ) from None
    os.close(fd)
    return Path(name)


def checked_shm_path(value: Any) -> Path:
    """A /dev/shm path from an init call, accepted only if it is one of ours: a regular file named
    `molt-refit-*` directly in /dev/shm, owned by this user."""
    if not isinstance(value, str):
        raise ValueError("ipc: the shared-memory path must be a string")
    path = Path(value)
    if path.parent != SHM_DIR or not path.name.startswith(PREFIX) or "/" in path.name:
        raise ValueError(f"ipc: {value!r} is not a refit file in {SHM_DIR}")
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        raise ValueError(
            f"ipc: {path} does not exist here: this engine does not share the trainer's {SHM_DIR} "
            "(another container?); set refit.backend = 'gloo'"
        ) from None
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
        raise ValueError(f"ipc: {path} is not a regular file of this user")
    return path


def shm_handle(path: Path, nbytes: int) -> dict[str, Any]:
    return {"kind": "shm", "path": str(path), "nbytes": nbytes}


def open_shm_handle(spec: dict[str, Any]) -> torch.Tensor:
    path, nbytes = checked_shm_path(spec.get("path")), _int(spec, "nbytes")
    if path.stat().st_size < nbytes:
        raise ValueError(f"ipc: {path} holds fewer than {nbytes} bytes")
    return torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)


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

    def drain(self, check: Callable[[], None]) -> None:
        """Block until every engine consumed every posted bucket."""
        self.wait_free(self.posted + len(self.buffers) - 1, check)

    def abort(self) -> None:
        """Make engines waiting for a bucket fail now (a failed push)."""
        self.control.set(ABORT, 1)

    def close(self) -> None:
        self.abort()
        self.unlink()
        self.control.close()  # releases the lock
        self.buffers = []
        if self.device.type == "cuda":
            torch.cuda.ipc_collect()


# -- the engine's side ------------------------------------------------------------------------------


class IpcInbox:
    """One engine's view of the trainer's slots and its own consumed counter."""

    def __init__(self, spec: dict[str, Any], timeout_s: float):
        consumer, consumers = _int(spec, "consumer"), _int(spec, "consumers")
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
        kinds = {s.get("kind") for s in slots}
        if kinds == {"cuda"}:
            uuid = spec.get("device_uuid")
            if not isinstance(uuid, str):
                raise ValueError("ipc: CUDA slots need the trainer's 'device_uuid'")
            self.buffers = [open_cuda_handle(s, uuid) for s in slots]
        elif kinds == {"shm"}:
            self.buffers = [open_shm_handle(s) for s in slots]
        else:
            raise ValueError(f"ipc: slots must all be 'cuda' or all 'shm', got {sorted(map(str, kinds))}")
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
