"""Who shares what with the trainer, and shared buffers as plain JSON fields (the refit's `ipc` transport).

`place()` is where a process's tensors live (host id, GPU UUIDs): engines report it in `/health`,
`choose_transports` compares it with the trainer's and picks shared memory or the broadcast group
per engine. A shared buffer travels as a handle made of JSON fields, never a pickle: a CUDA IPC
handle from `torch.multiprocessing.reductions.reduce_tensor` (rebuilt with `rebuild_cuda_tensor`,
every field type-checked), or the path of a private file in /dev/shm (accepted only if it is one of
ours).
"""

import base64
import binascii
import os
import socket
import stat
import tempfile
from pathlib import Path
from typing import Any

import torch

SHM_DIR = Path("/dev/shm")
PREFIX = "molt-refit-"
CUDA_HANDLE_BYTES = 64  # cudaIpcEventHandle_t; a memory handle is that or longer (expandable segments)
MAX_HANDLE_BYTES = 4096
CPU_AUTO = "ipc"
"""`refit.backend = "auto"` between a CPU trainer and an engine on its host: `ipc` (bench/refit.py, 126 MB
fp32 on 2 cores: 0.04-0.06 s against 0.24-0.36 s over gloo, 256 MiB buckets) or `gloo`."""


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


def shm_id() -> str | None:
    """Which /dev/shm this process sees (its filesystem and inode): containers of one host have their own."""
    try:
        st = os.stat(SHM_DIR)
    except OSError:  # no /dev/shm: no shared-memory refit
        return None
    return f"{st.st_dev}:{st.st_ino}"


def place(device: torch.device) -> dict[str, Any]:
    """Where a process's tensors live, as an engine reports it in `/health` and a sender compares it."""
    uuids = [device_uuid(device)] if device.type == "cuda" else []
    return {"host_id": host_id(), "shm_id": shm_id(), "device_uuids": uuids}


def same_gpu(mine: dict[str, Any], theirs: dict[str, Any]) -> bool:
    return bool(set(mine.get("device_uuids") or []) & set(theirs.get("device_uuids") or []))


def colocated(mine: dict[str, Any], theirs: dict[str, Any]) -> bool:
    """Whether an engine at `theirs` can map this process's buffers: the same host and /dev/shm (the
    control file lives there), and the same GPU for CUDA buffers."""
    shared = mine.get("shm_id") is not None and mine.get("shm_id") == theirs.get("shm_id")
    shared = shared and mine.get("host_id") == theirs.get("host_id")
    return shared and (same_gpu(mine, theirs) if mine.get("device_uuids") else True)


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
        on_my_gpu = theirs is not None and same_gpu(mine, theirs)
        if setting == "ipc" and not shared:
            what = f"GPU {mine['device_uuids'][0]}" if mine.get("device_uuids") else f"host {mine.get('host_id')}"
            raise ValueError(
                f"refit.backend = 'ipc' but engine {url} is not on this trainer's {what}: "
                "set refit.backend = 'auto' (NCCL or gloo to engines elsewhere)"
            )
        if setting == "ipc" or (setting == "auto" and shared and (on_my_gpu or host_ok)):
            out.append("ipc")
            continue
        if on_my_gpu and group_backend == "nccl" and setting == "auto":
            raise ValueError(
                f"engine {url} runs on this trainer's GPU {mine['device_uuids'][0]} but does not share its /dev/shm "
                "(another container?), and NCCL refuses two ranks on one GPU: give both one /dev/shm (docker: "
                "--ipc=host) or the engine its own GPU"
            )
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
    """Bytes from base64 text: exactly `size` of them, or 1 to MAX_HANDLE_BYTES."""
    if not isinstance(value, str) or len(value) > 2 * MAX_HANDLE_BYTES:
        raise ValueError(f"ipc {what}: expected base64 text of at most {MAX_HANDLE_BYTES} bytes")
    try:
        raw = base64.b64decode(value, validate=True)
    except binascii.Error:
        raise ValueError(f"ipc {what}: not base64") from None
    if (size is not None and len(raw) != size) or not 0 < len(raw) <= MAX_HANDLE_BYTES:
        raise ValueError(f"ipc {what}: {len(raw)} bytes" + (f", expected {size}" if size else ""))
    return raw


def as_count(spec: dict[str, Any], key: str) -> int:
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
    nbytes, offset = as_count(spec, "nbytes"), as_count(spec, "offset")
    storage_bytes, storage_offset = as_count(spec, "storage_bytes"), as_count(spec, "storage_offset")
    if offset + nbytes > storage_bytes:
        raise ValueError("ipc handle: the buffer does not fit in its storage")
    handle, counter = _unb64(spec.get("handle"), "handle"), _unb64(spec.get("ref_counter"), "ref_counter")
    counter_offset = as_count(spec, "ref_counter_offset")
    event = None if spec.get("event") is None else _unb64(spec["event"], "event", CUDA_HANDLE_BYTES)
    if not isinstance(spec.get("event_sync"), bool):
        raise ValueError("ipc handle: 'event_sync' must be true or false")
    return rebuild_cuda_tensor(
        torch.Tensor, torch.Size([nbytes]), (1,), offset, storages[spec["storage"]], torch.uint8,
        local_cuda_index(uuid), handle, storage_bytes, storage_offset, False, counter, counter_offset, event,
        spec["event_sync"],
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
    path, nbytes = checked_shm_path(spec.get("path")), as_count(spec, "nbytes")
    if path.stat().st_size < nbytes:
        raise ValueError(f"ipc: {path} holds fewer than {nbytes} bytes")
    return torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)
