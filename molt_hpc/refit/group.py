"""The refit communicator: one process group joined by trainer rank 0 and every engine, nothing else.

It is built directly on a backend class (`ProcessGroupGloo` / `ProcessGroupNCCL`) over a
`PrefixStore` of the trainer's TCPStore, so it never touches a default process group: the trainer's
torchrun world stays as it is and an engine needs none. A new prefix per generation lets the group
be re-formed when the set of engines changes. `new_group` is the one place that picks the backend.
"""

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from molt_hpc.net import listen_fd


def resolve_backend(setting: str, device: str | torch.device) -> str:
    """`refit.backend` → the group's `gloo` or `nccl`; `auto` (and `ipc`, for the engines it cannot
    reach through shared memory) follows the device the weights live on."""
    if setting not in ("auto", "gloo", "nccl", "ipc"):
        raise ValueError(f"refit.backend = {setting!r}; use auto, gloo, nccl or ipc")
    if setting in ("gloo", "nccl"):
        return setting
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def buffer_device(backend: str) -> torch.device:
    """Where broadcast buffers live: the current GPU for NCCL, host memory for gloo."""
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


@dataclass
class RefitGroup:
    """A formed refit group: the backend object, its rank, and the store keeping it alive."""

    backend: str
    rank: int
    world_size: int
    pg: dist.Backend
    store: dist.Store

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> dist.Work:
        """Start broadcasting `tensor` from `src`; `.wait()` the returned work before touching it."""
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        return self.pg.broadcast([tensor], opts)


def new_group(
    backend: str,
    store: dist.Store,
    prefix: str,
    rank: int,
    world_size: int,
    timeout_s: float,
) -> RefitGroup:
    """Join the group `prefix` on `store` as `rank` of `world_size`; blocks until every rank joined."""
    timeout = datetime.timedelta(seconds=timeout_s)
    prefixed = dist.PrefixStore(prefix, store)
    if backend == "gloo":
        pg = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    elif backend == "nccl":
        if not hasattr(dist, "ProcessGroupNCCL") or not torch.cuda.is_available():
            raise ValueError("refit.backend = 'nccl' needs a CUDA build of torch and a GPU; use gloo on CPU")
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
    else:
        raise ValueError(f"unknown refit backend {backend!r}; use gloo or nccl")
    return RefitGroup(backend, rank, world_size, pg, store)


def connect_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """A client of the trainer's TCPStore (the engine side of the rendezvous)."""
    return dist.TCPStore(host, port, None, False, datetime.timedelta(seconds=timeout_s))


def host_store(timeout_s: float) -> dist.TCPStore:
    """The trainer's TCPStore on a port the kernel picks (read it back from `.port`)."""
    fd = listen_fd(0)  # loopback in a local-mode run (`molt_hpc.net.listen_fd`)
    timeout = datetime.timedelta(seconds=timeout_s)
    return dist.TCPStore("0.0.0.0", 0, None, True, timeout, wait_for_workers=False, master_listen_fd=fd)
