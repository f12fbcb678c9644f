"""The engine side of the refit: join the trainer's group, receive flat buckets, load them by HF name.

Three transports: the broadcast group (gloo/NCCL); for an engine on the trainer's own GPU or host,
the trainer's shared slots (`ipc.py`: `init_info.backend = "ipc"`); or, on its GPU, the trainer's
parameters themselves (`shared_params.py`: `init_info.ipc.params`, updates with `shared_params`).
The engine's HTTP routes call these methods from a worker thread while its scheduler is paused, so
loading into the live parameters cannot race a decode step. A refused update (unknown name, wrong
shape) still drains every bucket of a broadcast, so the sender and the other engines stay in step;
over shared slots it is refused before any bucket is taken, and the sender sees the refusal while it
waits.
"""

import threading
import time
from typing import Any

import torch

from molt_hpc.log import get_logger
from molt_hpc.protocol.edge import parse
from molt_hpc.protocol.requests import InitInfo
from molt_hpc.refit.buckets import Bucket, CopyPlan, bucket_views, copy_tensors, metas_from_info, plan_buckets
from molt_hpc.refit.group import RefitGroup, buffer_device, connect_store, new_group
from molt_hpc.refit.ipc import ChannelClosed, IpcInbox
from molt_hpc.refit.shared_params import SharedParams


class RefitReceiver:
    """One engine's membership in the refit group."""

    def __init__(self) -> None:
        self.group: RefitGroup | None = None
        self.inbox: IpcInbox | None = None
        self.shared: SharedParams | None = None
        """The trainer's parameters, mapped: updates then copy from them in place."""
        self._reading: IpcInbox | None = None
        """The inbox a receive is reading now: a new init closes it only once that receive has ended."""
        self._lock = threading.Lock()
        self._buffers: list[torch.Tensor] = []
        self._views: dict[tuple[int, Bucket], list[torch.Tensor]] = {}
        """Typed views of each bucket inside each buffer, kept while the buffers are."""

    def init(self, init_info: dict[str, Any]) -> dict[str, Any]:
        """Join (or re-join under a new prefix) the group described by vLLM-style `init_info`, or map
        the trainer's shared slots (`backend = "ipc"`, the handles in `init_info.ipc`). The info is
        checked and the new channel opened before the old one is dropped: a refused init leaves the
        live channel as it was."""
        info = parse(InitInfo, init_info, "init_info")
        t0 = time.perf_counter()
        if info.backend == "ipc":
            assert info.ipc is not None
            if "params" in info.ipc:
                shared = SharedParams(info.ipc)
                self.leave()
                self.shared = shared
                get_logger().info(
                    "mapped the trainer's %d parameters (%.0f MiB, CUDA IPC): refits read them in place (%.2fs)",
                    len(shared.names), shared.nbytes / 2**20, time.perf_counter() - t0,
                )  # fmt: skip
                return {"transport": "ipc", "params": len(shared.names)}
            inbox = IpcInbox(info.ipc, info.timeout_s)
            self.leave()
            self.inbox = inbox
            get_logger().info(
                "mapped the trainer's %d refit slots of %.0f MiB (%s, %.2fs)", len(inbox.buffers),
                inbox.buffers[0].numel() / 2**20, "CUDA IPC" if inbox.buffers[0].is_cuda else "shared memory",
                time.perf_counter() - t0,
            )  # fmt: skip
            return {"transport": "ipc", "slots": len(inbox.buffers)}
        assert info.master_address and info.master_port and info.rank_offset and info.world_size
        rank, world = info.rank_offset, info.world_size
        store = connect_store(info.master_address, info.master_port, info.timeout_s)
        group = new_group(info.backend, store, info.group_name, rank, world, info.timeout_s)
        self.leave()
        self.group = group
        get_logger().info(
            "joined refit group %s as rank %d of %d (%.2fs)", info.group_name, rank, world, time.perf_counter() - t0
        )
        return {"rank": rank, "world_size": world}

    def leave(self) -> None:
        """Drop the group or the mapped slots (their peers may be gone) before joining anew."""
        self.group = None
        self._views = {}  # views of the old buffers or slots
        if self.shared is not None:
            self.shared.close()
            self.shared = None
        with self._lock:
            old, self.inbox = self.inbox, None
            if old is not None:
                old.replaced = True  # a receive still waiting on it stops at its next look
                if old is not self._reading:
                    old.close()

    def receive(self, update_info: dict[str, Any], params: dict[str, torch.Tensor]) -> int:
        """Receive every bucket of one update and copy each tensor into `params[name]`; returns the count.

        `params` maps HF names to the live tensors (tied weights may appear under two names).
        """
        if update_info.get("shared_params"):
            return self._copy_shared(update_info, params)
        if self.group is None and self.inbox is None:
            raise ValueError("no refit group: call /init_weight_transfer_engine before /update_weights")
        if not update_info.get("packed", False):
            raise ValueError("only packed updates are supported: set update_info.packed = true")
        metas = metas_from_info(update_info)
        bucket_bytes = update_info.get("bucket_bytes")
        if not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
            raise ValueError("update_info.bucket_bytes must be a positive integer (the sender's bucket size)")
        plan = plan_buckets(metas, bucket_bytes)
        problem = _check_targets(metas, params)
        if self.inbox is not None:
            if problem is not None:
                raise ValueError(problem)
            return self._receive_shared(plan, update_info.get("ipc_first"), params)
        self._ensure_buffers(max((b.nbytes for b in plan), default=0))
        loaded = 0
        pending = self._post(plan, 0)
        for k, bucket in enumerate(plan):
            pending.wait()
            pending = self._post(plan, k + 1)  # bucket k+1 arrives while bucket k is loaded
            if problem is None:
                views = self._views.get((k % 2, bucket))
                if views is None:
                    views = self._views[(k % 2, bucket)] = bucket_views(self._buffers[k % 2], bucket)
                with torch.no_grad():  # a few kernels per bucket
                    copy_tensors([params[m.name] for m in bucket.metas], views)
                loaded += len(views)
        if self._buffers and self._buffers[0].is_cuda:  # "loaded": in the parameters, not queued on the GPU
            torch.cuda.current_stream(self._buffers[0].device).synchronize()
        if problem is not None:
            raise ValueError(problem)
        return loaded

    def _copy_shared(self, update_info: dict[str, Any], params: dict[str, torch.Tensor]) -> int:
        """A few copy kernels (`CopyPlan`) from the trainer's mapped parameters into `params`, finished on the device
        before this returns (the trainer may change its parameters once every engine answered)."""
        shared = self.shared
        if shared is None:
            raise ValueError("no shared parameters: the trainer must share them (init with ipc.params) first")
        if update_info.get("names") != shared.names or update_info.get("shapes") != shared.shapes:
            shared.check([m.name for m in metas_from_info(update_info)])  # says which field or name is wrong
            raise ValueError("the update's shapes are not those of the tensors shared at init")
        if shared.targets is None or shared.targets[0] is not params:  # checked once per mapping and model
            problem = _check_targets(shared.metas(), params)
            if problem is not None:
                raise ValueError(problem)
            shared.targets = (params, CopyPlan([params[name] for name in shared.names], [t for _, t in shared.named]))
        _, plan = shared.targets
        with torch.no_grad():
            plan.run()
        torch.cuda.synchronize(plan.source[0].device)
        return len(plan.into)

    def _receive_shared(self, plan: list[Bucket], first: Any, params: dict[str, torch.Tensor]) -> int:
        """Copy bucket k of `plan` out of slot (first + k) as soon as the trainer posts it."""
        if not isinstance(first, int) or first < 0:
            raise ValueError("update_info.ipc_first (the channel's index of the first bucket) must be an integer >= 0")
        with self._lock:
            inbox = self._reading = self.inbox
        if inbox is None:
            raise ChannelClosed("a new refit channel is being set up; this update was dropped")
        try:
            return self._copy_out(inbox, plan, first, params)
        finally:
            with self._lock:
                self._reading = None
                if inbox.replaced:
                    inbox.close()

    def _copy_out(self, inbox: IpcInbox, plan: list[Bucket], first: int, params: dict[str, torch.Tensor]) -> int:
        loaded = 0
        for k, bucket in enumerate(plan):
            g = first + k
            if bucket.nbytes > inbox.slot(g).numel():
                raise ValueError(f"refit bucket {k} ({bucket.nbytes} bytes) does not fit the shared slots")
            inbox.wait_posted(g)
            key = (g % len(inbox.buffers), bucket)
            views = inbox.views.get(key)
            if views is None:
                views = inbox.views[key] = bucket_views(inbox.slot(g), bucket)
            with torch.no_grad():
                copy_tensors([params[m.name] for m in bucket.metas], views)
            inbox.consumed(g)
            loaded += len(views)
        return loaded

    def _post(self, plan, k: int):
        """Start receiving bucket `k` into buffer `k % 2`; its work, or None past the end."""
        if k >= len(plan):
            return None
        assert self.group is not None
        return self.group.broadcast(self._buffers[k % 2][: plan[k].nbytes], src=0)

    def _ensure_buffers(self, nbytes: int) -> None:
        """Two receive buffers, kept across updates (fresh pages make the first refit slow)."""
        assert self.group is not None
        dev = buffer_device(self.group.backend)
        if not self._buffers or self._buffers[0].numel() < nbytes or self._buffers[0].device != dev:
            self._buffers = [torch.empty(nbytes, dtype=torch.uint8, device=dev) for _ in range(2)]
            self._views = {}


def _check_targets(metas, params: dict[str, torch.Tensor]) -> str | None:
    """Why this update cannot be loaded (unknown names, shape mismatches), or None when it can."""
    unknown = [m.name for m in metas if m.name not in params]
    if unknown:
        shown = ", ".join(unknown[:5]) + (" ..." if len(unknown) > 5 else "")
        return f"update names {len(unknown)} tensor(s) this model does not have: {shown}"
    bad = [
        f"{m.name} {list(m.shape)} vs {list(params[m.name].shape)}"
        for m in metas
        if m.shape != tuple(params[m.name].shape)
    ]
    if bad:
        return "shape mismatch (sent vs model): " + "; ".join(bad[:5])
    return None
