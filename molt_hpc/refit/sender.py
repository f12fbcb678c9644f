"""The trainer side of the refit: `RefitSender` on trainer rank 0.

    sender = RefitSender(run_dir, cfg.refit, token)
    sender.connect(engine_urls)                  # (re)form the group with these engines
    sender.push(model.named_parameters(), version=step)

`connect` hosts the TCPStore (once), publishes `rendezvous/refit_store.json`, tells each engine to
join at rank `1 + i` and joins as rank 0 at the same time (the group forms only when all ranks are
in). `push` pauses the engines at a step boundary, streams the weights as flat buckets while the
engines' `/update_weights` calls are in flight, then has them load, bump the version and resume.
Call `connect` again when the set of engines changes (an engine restarted): it forms a new group
under a new prefix.
"""

import functools
import json
import socket
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import torch

from molt_hpc.config.infra import RefitConfig
from molt_hpc.log import get_logger
from molt_hpc.refit.buckets import (
    Bucket,
    TensorMeta,
    bucket_views,
    dtype_from_name,
    pack_into,
    plan_buckets,
    update_info,
)
from molt_hpc.refit.calls import EngineCalls
from molt_hpc.refit.group import RefitGroup, buffer_device, host_store, new_group, resolve_backend
from molt_hpc.rundir import RunDir, atomic_write

STORE_FILE = "refit_store.json"


@dataclass(frozen=True)
class RefitStats:
    """What one push moved and how long it took."""

    version: int
    seconds: float
    bytes: int
    buckets: int
    engines: int

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


def advertised_host(setting: str) -> str:
    """The address engines use to reach this node's TCPStore (`auto`: the hostname if it resolves)."""
    if setting != "auto":
        return setting
    name = socket.gethostname()
    try:
        socket.gethostbyname(name)
    except OSError:  # an unresolvable hostname: only loopback can work (local mode)
        return "127.0.0.1"
    return name


class RefitSender:
    """Pushes full weights from trainer rank 0 to every engine of the pool."""

    def __init__(self, run_dir: str | Path, cfg: RefitConfig, token: str, device: str | torch.device = "cpu"):
        self.run = RunDir(Path(run_dir))
        self.cfg = cfg
        self.token = token
        self.backend = resolve_backend(cfg.backend, device)
        self.host = advertised_host(cfg.host)
        self.urls: list[str] = []
        self._store = None
        self._group: RefitGroup | None = None
        self._generation = 0
        self._buffers: list[torch.Tensor] = []
        self._views: dict[tuple[int, Bucket], list[torch.Tensor]] = {}
        self._calls = EngineCalls(token, cfg.timeout_s)

    @property
    def store_port(self) -> int:
        assert self._store is not None, "connect() first"
        return self._store.port

    def connect(self, engine_urls: Sequence[str]) -> None:
        """Form a new refit group with exactly `engine_urls` (engine i joins at rank 1 + i)."""
        if not engine_urls:
            raise ValueError("connect() needs at least one engine URL")
        if self._store is None:
            self._store = host_store(self.cfg.timeout_s)
            atomic_write(self.run.rendezvous / STORE_FILE, json.dumps({"host": self.host, "port": self._store.port}))
        self._group = None  # drop the old group before the engines drop theirs
        self._generation += 1
        prefix = f"refit/{self._generation}/"
        world = 1 + len(engine_urls)
        t0 = time.perf_counter()
        calls = [
            self._calls.post(
                url,
                "/init_weight_transfer_engine",
                {
                    "init_info": {
                        "master_address": self.host,
                        "master_port": self._store.port,
                        "rank_offset": 1 + i,
                        "world_size": world,
                        "group_name": prefix,
                        "backend": self.backend,
                        "timeout_s": self.cfg.timeout_s,
                    }
                },
            )
            for i, url in enumerate(engine_urls)
        ]
        join = functools.partial(new_group, self.backend, self._store, prefix, 0, world, self.cfg.timeout_s)
        self._group = self._calls.form(join, calls, engine_urls, f"refit group {prefix}")
        self.urls = list(engine_urls)
        get_logger().info(
            "refit group %d formed with %d engines in %.2fs", self._generation, len(self.urls), time.perf_counter() - t0
        )

    def push(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        version: int,
        metas: Sequence[TensorMeta] | None = None,
    ) -> RefitStats:
        """Send full tensors (HF names) to every engine and make `version` their weight version.

        `named_tensors` may be a generator (e.g. gathering FSDP shards layer by layer); then pass
        `metas` (names, dtypes, shapes in the same order) so the bucket plan is known up front.
        """
        if self._group is None:
            raise ValueError(
                "RefitSender.push() without a refit group: call connect(engine_urls) first (a failed push drops it)"
            )
        t0 = time.perf_counter()
        items: Iterable[tuple[str, torch.Tensor]] = named_tensors
        if metas is None:
            items = list(named_tensors)
            metas = [TensorMeta.of(name, t) for name, t in items]
        bucket_bytes = self.cfg.bucket_mb << 20
        plan = plan_buckets(metas, bucket_bytes)
        try:
            self._calls.round(self.urls, "/start_weight_update")
            info = update_info(metas, bucket_bytes, version)
            calls = [self._calls.post(url, "/update_weights", {"update_info": info}) for url in self.urls]
            self._send_buckets(plan, iter(items), calls)
            self._calls.wait(calls, self.urls, "update_weights")
            self._calls.round(self.urls, "/finish_weight_update", {"version": version})
        except BaseException:
            # Dropping the group closes its connections, so engines blocked in a receive fail now
            # instead of at the timeout; they stay paused until a complete push (re-connect first).
            self._group = None
            raise
        total = sum(b.nbytes for b in plan)
        stats = RefitStats(version, time.perf_counter() - t0, total, len(plan), len(self.urls))
        get_logger().info(
            "refit v%d: %.1f MB in %d buckets to %d engines, %.2fs (%.2f GB/s)",
            version,
            total / 1e6,
            len(plan),
            len(self.urls),
            stats.seconds,
            stats.gb_per_s,
        )
        return stats

    def close(self) -> None:
        self._group = None
        self._store = None
        self._calls.close()

    def _send_buckets(self, plan, items, calls: list[Future]) -> None:
        """Pack bucket k+1 while bucket k is on the wire (two buffers and their views, reused across pushes)."""
        assert self._group is not None
        size = max((b.nbytes for b in plan), default=0)
        if not self._buffers or self._buffers[0].numel() < size:
            dev = buffer_device(self.backend)
            self._buffers = [torch.empty(size, dtype=torch.uint8, device=dev) for _ in range(2)]
            self._views = {}
        pending: list = [None, None]
        for k, bucket in enumerate(plan):
            slot = k % 2
            if pending[slot] is not None:
                pending[slot].wait()
            tensors = [_checked(next(items), meta) for meta in bucket.metas]
            views = self._views.get((slot, bucket))
            if views is None:
                views = self._views[(slot, bucket)] = bucket_views(self._buffers[slot], bucket)
            flat = pack_into(self._buffers[slot], bucket, tensors, views)
            self._calls.check(calls, self.urls)
            pending[slot] = self._group.broadcast(flat)
        for work in pending:
            if work is not None:
                work.wait()


def _checked(item: tuple[str, torch.Tensor], meta: TensorMeta) -> torch.Tensor:
    """The tensor of `item` if it is the one `meta` announced: same name and shape, and the same dtype or
    another floating one (packing casts it, e.g. fp32 master weights sent as bf16)."""
    name, tensor = item
    want = dtype_from_name(meta.dtype)
    same_kind = tensor.dtype == want or (tensor.dtype.is_floating_point and want.is_floating_point)
    if name != meta.name or tuple(tensor.shape) != meta.shape or not same_kind:
        raise ValueError(f"refit tensor {TensorMeta.of(name, tensor)} does not match its announced metadata {meta}")
    return tensor
