"""The trainer side of the refit: `RefitSender` on trainer rank 0.

    sender = RefitSender(run_dir, cfg.refit, token)
    sender.connect(engine_urls)                  # (re)form the group with these engines
    sender.push(model.named_parameters(), version=step)

`connect` asks each engine where it runs (`/health`) and picks its transport (`ipc.choose_transports`:
shared memory for an engine on this trainer's GPU, where NCCL cannot go, or host; the group
otherwise; the choice is logged). For the group it hosts the TCPStore (once), publishes
`rendezvous/refit_store.json`, tells each group engine to join at rank `1 + i` and joins as rank 0 at
the same time (the group forms only when all ranks are in); the other engines map the slots it
shares with them. `push` pauses the engines at a step boundary, streams the weights as flat buckets
(broadcast, or posted in the shared slots) while the engines' `/update_weights` calls are in flight,
then has them load, bump the version and resume (engines that all take the bytes through shared memory
do the pause, the load and the resume in their one `/update_weights` call). Call `connect` again when the set of engines
changes (an engine restarted): it forms a new group under a new prefix, and shares new slots.

`push(..., in_place=True)` says the tensors are the trainer's own parameters (whole, at fixed addresses):
when every engine is on this trainer's GPU they then read them in place (`shared_params.py`), with no
bucket packed at all; the parameters are shared again whenever their addresses change.
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
from molt_hpc.net import loopback_only
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
from molt_hpc.refit.handles import choose_transports, place
from molt_hpc.refit.ipc import IpcChannel
from molt_hpc.refit.shared_params import addresses, share, shareable
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
    if loopback_only():  # a local-mode run: the store listens on loopback only
        return "127.0.0.1"
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
        self.device = torch.device(device)
        self.host = advertised_host(cfg.host)
        self.urls: list[str] = []
        self.transports: dict[str, str] = {}
        """Each connected engine's transport: `ipc` or the group's backend."""
        self._store = None
        self._group: RefitGroup | None = None
        self._channel: IpcChannel | None = None
        self._in_place: _InPlace | None = None
        """What the engines mapped and the update that names it, or None when they mapped nothing."""
        self._logged: set[tuple[str, ...]] = set()
        self._generation = 0
        self._buffers: list[torch.Tensor] = []
        self._views: dict[tuple[int, Bucket], list[torch.Tensor]] = {}
        self._calls = EngineCalls(token, cfg.timeout_s)

    @property
    def store_port(self) -> int:
        assert self._store is not None, "connect() first"
        return self._store.port

    def connect(self, engine_urls: Sequence[str]) -> None:
        """Reach exactly `engine_urls`: a new refit group with those that need one (the i-th joins at rank
        1 + i) and new shared slots for those on this trainer's GPU (or host)."""
        if not engine_urls:
            raise ValueError("connect() needs at least one engine URL")
        self._drop()  # the old group and slots before the engines drop theirs
        mine = place(self.device)
        places = self._calls.places(engine_urls)
        kinds = choose_transports(
            self.cfg.backend, self.backend, mine, places, list(engine_urls), self.cfg.bucket_mb << 20
        )
        self._log_choice(mine, engine_urls, kinds)
        grouped = [u for u, k in zip(engine_urls, kinds, strict=True) if k != "ipc"]
        t0 = time.perf_counter()
        if grouped:
            self._form(grouped)  # the shared-memory engines map their slots at the first push (sized by its plan)
        self.urls = list(engine_urls)
        self.transports = dict(zip(engine_urls, kinds, strict=True))
        get_logger().info(
            "refit reaches %d engines (%d in group %d, %d through shared memory) in %.2fs", len(self.urls),
            len(grouped), self._generation, len(self.urls) - len(grouped), time.perf_counter() - t0,
        )  # fmt: skip

    def _log_choice(self, mine: dict, urls: Sequence[str], kinds: list[str]) -> None:
        """Say once per distinct choice how the weights reach the engines."""
        if tuple(kinds) in self._logged:
            return
        self._logged.add(tuple(kinds))
        where = f"GPU {mine['device_uuids'][0]}" if mine["device_uuids"] else f"host {mine['host_id']}"
        for url, kind in zip(urls, kinds, strict=True):
            how = "CUDA IPC" if kind == "ipc" and mine["device_uuids"] else "shared memory" if kind == "ipc" else kind
            why = f"shares this trainer's {where}" if kind == "ipc" else f"refit.backend = {self.cfg.backend!r}"
            get_logger().info("refit transport to %s: %s (%s)", url, how, why)

    def _share(self, urls: Sequence[str], slot_bytes: int) -> None:
        """New shared slots of `slot_bytes` for the engines at `urls`, mapped by each before this returns."""
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        self._in_place = None  # the engines drop the mapped parameters at this init
        channel = IpcChannel(buffer_device(self.backend) if self.device.type == "cuda" else self.device,
                             slot_bytes, len(urls), self.cfg.timeout_s)  # fmt: skip
        self._buffers, self._views = [], {}
        try:
            calls = [
                self._calls.post(url, "/init_weight_transfer_engine", {
                    "init_info": {"backend": "ipc", "ipc": channel.init_info(i), "timeout_s": self.cfg.timeout_s}
                })
                for i, url in enumerate(urls)
            ]  # fmt: skip
            self._calls.wait(calls, urls, "init_weight_transfer_engine")
        except BaseException:
            channel.close()
            raise
        channel.unlink()  # every engine mapped the slots: their names can go
        self._channel = channel

    def _form(self, engine_urls: Sequence[str]) -> None:
        """A new broadcast group of trainer rank 0 and `engine_urls`."""
        if self._store is None:
            self._store = host_store(self.cfg.timeout_s)
            atomic_write(self.run.rendezvous / STORE_FILE, json.dumps({"host": self.host, "port": self._store.port}))
        self._generation += 1
        prefix = f"refit/{self._generation}/"
        world = 1 + len(engine_urls)
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

    def push(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        version: int,
        metas: Sequence[TensorMeta] | None = None,
        in_place: bool = False,
        extra: dict | None = None,
    ) -> RefitStats:
        """Send full tensors (HF names) to every engine and make `version` their weight version.

        `named_tensors` may be a generator (e.g. gathering FSDP shards layer by layer); then pass
        `metas` (names, dtypes, shapes in the same order) so the bucket plan is known up front.
        `in_place`: the tensors are the trainer's live parameters, unchanged until this returns.
        `extra`: more `update_info` fields (a LoRA refit's `lora_scaling`: the tensors are adapters).
        """
        if not self.urls:
            raise ValueError(
                "RefitSender.push() without a refit group: call connect(engine_urls) first (a failed push drops it)"
            )
        t0 = time.perf_counter()
        items: Iterable[tuple[str, torch.Tensor]] = named_tensors
        if (
            extra is None
            and in_place
            and self.device.type == "cuda"
            and all(self.transports[u] == "ipc" for u in self.urls)
        ):
            items = list(items)
            mapped = self._in_place
            if mapped is not None and mapped.metas is metas and mapped.key == addresses(items):
                return self._push_in_place(items, version, mapped, t0)  # checked when it was mapped
            for item, meta in zip(items, metas or [], strict=metas is not None):
                _checked(item, meta)
            if shareable(items):
                return self._push_in_place(items, version, None, t0, metas)
        if metas is None:
            items = list(items)
            metas = [TensorMeta.of(name, t) for name, t in items]
        plan = self._push_buckets(items, version, metas, extra)
        total = sum(b.nbytes for b in plan)
        stats = RefitStats(version, time.perf_counter() - t0, total, len(plan), len(self.urls))
        get_logger().info("refit v%d: %.1f MB in %d buckets to %d engines, %.2fs (%.2f GB/s)", version, total / 1e6,
                          len(plan), len(self.urls), stats.seconds, stats.gb_per_s)  # fmt: skip
        return stats

    def _push_buckets(self, items, version: int, metas: Sequence[TensorMeta], extra: dict | None) -> list:
        """The bucketed push (start, update with the buckets, finish) to every engine; its bucket plan."""
        bucket_bytes = self.cfg.bucket_mb << 20
        plan = plan_buckets(metas, bucket_bytes)
        try:
            shared = [u for u in self.urls if self.transports[u] == "ipc"]
            need = max((b.nbytes for b in plan), default=1)
            if shared and (self._channel is None or need > self._channel.slot_bytes):  # first push, or outgrown
                self._share(shared, need)
            # Every engine behind shared memory: start and finish ride on the update call (one round trip, not
            # three); a broadcast group's engines must all be paused before its first bucket goes out.
            folded = len(shared) == len(self.urls)
            if not folded:
                self._calls.round(self.urls, "/start_weight_update")
            info = {**update_info(metas, bucket_bytes, version), **(extra or {})}
            if self._channel is not None:
                info["ipc_first"] = self._channel.posted
            body = {"update_info": info, **({"start": True, "finish_version": version} if folded else {})}
            calls = [self._calls.post(url, "/update_weights", body) for url in self.urls]
            self._send_buckets(plan, iter(items), calls)
            self._calls.wait(calls, self.urls, "update_weights")
            if not folded:
                self._calls.round(self.urls, "/finish_weight_update", {"version": version})
        except BaseException:
            # Dropping the group closes its connections (and aborting the slots wakes their readers), so
            # engines blocked in a receive fail now instead of at the timeout; they stay paused until a
            # complete push (re-connect first).
            self._drop()
            raise
        return plan

    def _push_in_place(
        self, items: list[tuple[str, torch.Tensor]], version: int, mapped: "_InPlace | None", t0: float, metas=None
    ) -> RefitStats:
        """Every engine reads `items` where they are: share them first unless `mapped` says the engines
        hold exactly these, wait for this device, then one call per engine that pauses, copies and resumes."""
        try:
            if mapped is None:
                mapped = self._share_params(items, metas)
            torch.cuda.current_stream(self.device).synchronize()  # the optimizer's writes land before any read
            info = {**mapped.info, "version": version}
            marks = [time.perf_counter()]
            body = {"update_info": info, "start": True, "finish_version": version}  # one round trip
            answers = self._calls.round(self.urls, "/update_weights", body)
            marks.append(time.perf_counter())
        except BaseException:
            self._drop()
            raise
        stats = RefitStats(version, time.perf_counter() - t0, mapped.wire_bytes, 0, len(self.urls))
        get_logger().info(
            "refit v%d: %d parameters (%.1f MB as sent) read in place by %d engines, %.1f ms (before the call "
            "%.1f, the call to pause, copy and resume %.1f, of which the engines' copy %.1f)", version, len(items),
            mapped.wire_bytes / 1e6, len(self.urls), 1000 * stats.seconds, 1000 * (marks[0] - t0),
            1000 * (marks[1] - marks[0]), 1000 * max(float(a.get("seconds", 0.0)) for a in answers),
        )  # fmt: skip
        return stats

    def _share_params(self, items: list[tuple[str, torch.Tensor]], metas) -> "_InPlace":
        """Share the CUDA IPC handles of `items` with every engine (each maps them before this returns)."""
        if self._channel is not None:  # the engines drop their slots at this init
            self._channel.close()
            self._channel = None
        self._in_place = None
        t0 = time.perf_counter()
        spec = {"params": share(items), "device_uuid": place(self.device)["device_uuids"][0]}
        body = {"init_info": {"backend": "ipc", "ipc": spec, "timeout_s": self.cfg.timeout_s}}
        self._calls.round(self.urls, "/init_weight_transfer_engine", body)
        get_logger().info(
            "shared %d parameters with %d engines through CUDA IPC (%.2fs): refits read them in place",
            len(items), len(self.urls), time.perf_counter() - t0,
        )  # fmt: skip
        wire = list(metas) if metas is not None else [TensorMeta.of(n, t) for n, t in items]
        info = {**update_info([TensorMeta.of(n, t) for n, t in items], self.cfg.bucket_mb << 20, 0),
                "shared_params": True}  # fmt: skip
        self._in_place = _InPlace(addresses(items), metas, info, sum(m.nbytes for m in wire))
        return self._in_place

    def close(self) -> None:
        self._drop()
        self._store = None
        self._calls.close()

    def _drop(self) -> None:
        self._group = None
        self.urls = []
        self._in_place = None
        if self._channel is not None:
            self._channel.close()
            self._channel = None
            self._buffers, self._views = [], {}

    def _send_buckets(self, plan, items, calls: list[Future]) -> None:
        """Pack bucket k+1 while bucket k is on the wire (two buffers and their views, reused across pushes).
        With shared slots the buffers are the slots: each bucket is broadcast from it (if a group is
        formed) and posted to the shared-memory engines; a slot is reused once both are done with it."""
        channel, first = self._channel, self._channel.posted if self._channel is not None else 0
        size = max((b.nbytes for b in plan), default=0)
        if channel is not None:
            self._buffers = channel.buffers
        elif not self._buffers or self._buffers[0].numel() < size:
            dev = buffer_device(self.backend)
            self._buffers = [torch.empty(size, dtype=torch.uint8, device=dev) for _ in range(2)]
            self._views = {}
        check = functools.partial(self._calls.check, calls, self.urls)
        pending: list = [None, None]
        for k, bucket in enumerate(plan):
            slot = (first + k) % 2
            if pending[slot] is not None:
                pending[slot].wait()
            if channel is not None:
                channel.wait_free(first + k, check)
            tensors = [_checked(next(items), meta) for meta in bucket.metas]
            views = self._views.get((slot, bucket))
            if views is None:
                views = self._views[(slot, bucket)] = bucket_views(self._buffers[slot], bucket)
            flat = pack_into(self._buffers[slot], bucket, tensors, views)
            check()
            if self._group is not None:
                pending[slot] = self._group.broadcast(flat)
            if channel is not None:
                channel.post(first + k)
        for work in pending:
            if work is not None:
                work.wait()


@dataclass(frozen=True)
class _InPlace:
    """The parameters the engines mapped: their addresses (`shared_params.addresses`), the metadata the
    caller announced with them (the same object at each push: the caller caches it), the update that
    names them (its version set per push) and their size as the engines' dtype."""

    key: tuple
    metas: Sequence[TensorMeta] | None
    info: dict
    wire_bytes: int


def _checked(item: tuple[str, torch.Tensor], meta: TensorMeta) -> torch.Tensor:
    """The tensor of `item` if it is the one `meta` announced: same name and shape, and the same dtype or
    another floating one (packing casts it, e.g. fp32 master weights sent as bf16)."""
    name, tensor = item
    want = dtype_from_name(meta.dtype)
    same_kind = tensor.dtype == want or (tensor.dtype.is_floating_point and want.is_floating_point)
    if name != meta.name or tuple(tensor.shape) != meta.shape or not same_kind:
        raise ValueError(f"refit tensor {TensorMeta.of(name, tensor)} does not match its announced metadata {meta}")
    return tensor
