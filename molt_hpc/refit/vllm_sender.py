"""The trainer side of a refit into `vllm serve` engines, through vLLM's own weight-transfer API.

    sender = VllmRefitSender(cfg.refit, token)
    sender.connect(engine_urls)                     # every engine's workers + trainer rank 0, one NCCL group
    sender.push(named_tensors, version, metas)      # pause → start → update (packed) → finish → reset → resume

vLLM 0.26's NCCL rendezvous is its own `StatelessProcessGroup`: a TCPStore the trainer hosts, through
which the NCCL unique id travels pickled as a vLLM ctypes type. Speaking that wire format without vLLM
would mean copying its private types, so this side imports vLLM's trainer helpers
(`NCCLWeightTransferEngine.trainer_init` / `trainer_send_weights`): the packing, buffer count and
unique-id exchange then match the engines by construction. The actor pool needs the `gpu` extra.

An engine is `world_size` workers (its `/get_world_size`: TP × PP × DP, vLLM numbering its data-parallel
replicas' workers consecutively); engine i's workers take ranks `1 + (sizes of engines before i)`. A push
pauses every engine in `keep` mode (in-flight requests freeze), streams the weights while the engines'
`/update_weights` calls are in flight, stamps the version (`/finish_weight_update`, read by our front),
resets the prefix cache with running requests preempted (their KV is recomputed with the new weights) and
resumes.

An engine on this trainer's own GPU (its `/health` `device_uuids`, from our worker extension) cannot
join an NCCL group with it. It gets the shared-memory refit instead: the trainer shares CUDA IPC
handles of its bucket slots once (`/collective_rpc molt_ipc_init`), and each push packs the buckets
into them while the engine's `molt_ipc_update` copies them into vLLM's weights (`engine/vllm/ipc.py`).
One push can serve both kinds: each tensor goes to the slots and on to vLLM's NCCL packer.
"""

import functools
import json
import time
import urllib.request
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future
from typing import Any

import torch

from molt_hpc.config.infra import RefitConfig
from molt_hpc.log import get_logger
from molt_hpc.net import free_port
from molt_hpc.refit.buckets import TensorMeta, dtype_from_name, plan_buckets, tensor_lists, update_info
from molt_hpc.refit.calls import HTTP_GRACE_S, EngineCalls
from molt_hpc.refit.handles import choose_transports, place
from molt_hpc.refit.ipc import IpcChannel, SlotWriter
from molt_hpc.refit.sender import RefitStats, advertised_host

NUM_BUFFERS = 2
"""Packed buffers in flight (vLLM's double buffering); both ends must agree, so it travels in update_info."""


def import_vllm_transfer():
    """vLLM's NCCL weight-transfer engine class, or a `ValueError` saying how to get it."""
    try:
        from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine
    except ImportError as err:
        raise ValueError(
            f"engines.kind = 'vllm' needs vLLM on the actor pool too (it speaks vLLM's weight-transfer protocol): "
            f"pip install 'molt-hpc[gpu]' ({err})"
        ) from None
    return NCCLWeightTransferEngine


def get_json(url: str, token: str, timeout_s: float) -> dict[str, Any]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return json.loads(resp.read() or b"{}")


def vllm_update_info(metas: Sequence[TensorMeta], bucket_bytes: int) -> dict[str, Any]:
    """The `update_info` of vLLM's `/update_weights` for packed NCCL buckets of `bucket_bytes`."""
    packing = {"packed": True, "packed_buffer_size_bytes": bucket_bytes, "packed_num_buffers": NUM_BUFFERS}
    return {**tensor_lists(metas), **packing}


def rank_offsets(sizes: Sequence[int]) -> list[int]:
    """First rank of each engine's workers in the refit group (the trainer is rank 0)."""
    offsets, nxt = [], 1
    for size in sizes:
        offsets.append(nxt)
        nxt += size
    return offsets


class VllmRefitSender:
    """Pushes full weights from trainer rank 0 to `vllm serve` engines (same interface as `RefitSender`)."""

    def __init__(self, cfg: RefitConfig, token: str, device: str | torch.device = "cuda"):
        self.cfg = cfg
        self.token = token
        self.host = advertised_host(cfg.host)
        dev = torch.device(device)
        self.device_index = dev.index if dev.index is not None else torch.cuda.current_device()
        self.urls: list[str] = []
        self.transports: dict[str, str] = {}
        self._group = None
        self._channel: IpcChannel | None = None
        self._calls = EngineCalls(token, cfg.timeout_s)

    def connect(self, engine_urls: Sequence[str]) -> None:
        """Reach exactly `engine_urls`: a new NCCL group with the engines on other GPUs (each with all its
        TP workers), new shared slots for those on this trainer's GPU."""
        if not engine_urls:
            raise ValueError("connect() needs at least one engine URL")
        self._drop()
        t0 = time.perf_counter()
        sizes = [
            int(get_json(f"{u.rstrip('/')}/get_world_size?include_dp=true", self.token, 30.0)["world_size"])
            for u in engine_urls
        ]
        mine = place(torch.device("cuda", self.device_index))
        places = self._calls.places(engine_urls)
        kinds = choose_transports(self.cfg.backend, "nccl", mine, places, list(engine_urls), self.cfg.bucket_mb << 20)
        for url, kind, size in zip(engine_urls, kinds, sizes, strict=True):
            if kind == "ipc" and size > 1:
                raise ValueError(
                    f"vLLM engine {url} has {size} tensor-parallel workers and one runs on this trainer's GPU: the "
                    "shared-memory refit feeds one worker; set engines.tensor_parallel = 1 or give the trainer a GPU"
                )
            how = "CUDA IPC (it shares this trainer's GPU)" if kind == "ipc" else "NCCL"
            get_logger().info("refit transport to vLLM engine %s: %s", url, how)
        shared = [u for u, k in zip(engine_urls, kinds, strict=True) if k == "ipc"]  # slots: at the first push
        grouped = [(u, n) for u, k, n in zip(engine_urls, kinds, sizes, strict=True) if k != "ipc"]
        if grouped:
            self._form([u for u, _ in grouped], [n for _, n in grouped])
        self.urls = list(engine_urls)
        self.transports = dict(zip(engine_urls, kinds, strict=True))
        get_logger().info(
            "vLLM refit reaches %d engines (%d through shared memory), %.2fs",
            len(self.urls), len(shared), time.perf_counter() - t0,
        )  # fmt: skip

    def _rpc(self, url: str, method: str, arg: dict[str, Any]) -> Future:
        """Our worker extension's `method` on every worker of the engine at `url`, with one JSON argument."""
        body = {"method": method, "args": [json.dumps(arg)], "timeout": self.cfg.timeout_s + HTTP_GRACE_S / 2}
        return self._calls.post(url, "/collective_rpc", body)

    def _share(self, urls: Sequence[str], slot_bytes: int) -> None:
        """New CUDA IPC slots of `slot_bytes`, mapped by the workers of the engines at `urls` before this returns."""
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        channel = IpcChannel(torch.device("cuda", self.device_index), slot_bytes, len(urls), self.cfg.timeout_s)
        try:
            calls = [
                self._rpc(url, "molt_ipc_init", {"ipc": channel.init_info(i), "timeout_s": self.cfg.timeout_s})
                for i, url in enumerate(urls)
            ]
            self._calls.wait(calls, urls, "molt_ipc_init")
        except BaseException:
            channel.close()
            raise
        channel.unlink()
        self._channel = channel

    def _form(self, engine_urls: Sequence[str], sizes: Sequence[int]) -> None:
        transfer = import_vllm_transfer()
        world, port = 1 + sum(sizes), free_port()
        calls = [
            self._calls.post(url, "/init_weight_transfer_engine", {
                "init_info": {"master_address": self.host, "master_port": port, "rank_offset": off, "world_size": world}
            })
            for url, off in zip(engine_urls, rank_offsets(sizes), strict=True)
        ]  # fmt: skip
        join = functools.partial(self._trainer_init, transfer, port, world)
        self._group = self._calls.form(join, calls, engine_urls, "the vLLM refit group")

    def _trainer_init(self, transfer, port: int, world: int):
        torch.cuda.set_device(self.device_index)  # the current device is per thread; vLLM's helper reads it
        return transfer.trainer_init({"master_address": self.host, "master_port": port, "world_size": world})

    def push(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        version: int,
        metas: Sequence[TensorMeta] | None = None,
        in_place: bool = False,
    ) -> RefitStats:
        """Send full tensors (HF names) to every engine and make `version` what they serve next.

        `in_place` (the tensors are the trainer's own parameters) changes nothing here: vLLM's workers on
        this GPU load from the shared slots, bucket by bucket, as from any other sender."""
        del in_place
        if not self.urls:
            raise ValueError("VllmRefitSender.push() without a group: call connect(engine_urls) first")
        items: Iterable[tuple[str, torch.Tensor]] = named_tensors
        if metas is None:
            items = list(named_tensors)
            metas = [TensorMeta.of(name, t) for name, t in items]
        bucket_bytes = self.cfg.bucket_mb << 20
        grouped = [u for u in self.urls if self.transports[u] != "ipc"]
        shared = [u for u in self.urls if self.transports[u] == "ipc"]
        plan = plan_buckets(metas, bucket_bytes) if shared else []
        t0 = time.perf_counter()
        try:
            need = max((b.nbytes for b in plan), default=1)
            if shared and (self._channel is None or need > self._channel.slot_bytes):  # first push, or outgrown
                self._share(shared, need)
            self._calls.round(self.urls, "/pause?mode=keep")
            calls, urls = self._updates(grouped, shared, metas, bucket_bytes, version)
            check = functools.partial(self._calls.check, calls, urls)
            stream = _checked(iter(items), metas)
            with torch.cuda.device(self.device_index):
                if shared:
                    assert self._channel is not None
                    stream = _feeding(stream, SlotWriter(self._channel, plan, check))
                if grouped:
                    self._send_nccl(stream, metas, bucket_bytes, check)
                else:
                    for _ in stream:  # the slot writer does the work
                        pass
                torch.cuda.synchronize()
            self._calls.wait(calls, urls, "update_weights")
            self._calls.round(self.urls, "/finish_weight_update", {"version": version})
            self._calls.round(self.urls, "/reset_prefix_cache?reset_running_requests=true")
            self._calls.round(self.urls, "/resume")
        except BaseException:
            # The engines stay paused until a complete push; the next one forms a new group first.
            self._drop()
            raise
        total = sum(m.nbytes for m in metas)
        stats = RefitStats(version, time.perf_counter() - t0, total, -(-total // bucket_bytes), len(self.urls))
        get_logger().info(
            "refit v%d: %.1f MB to %d vLLM engines, %.2fs (%.2f GB/s)",
            version,
            total / 1e6,
            len(self.urls),
            stats.seconds,
            stats.gb_per_s,
        )
        return stats

    def _updates(self, grouped, shared, metas, bucket_bytes: int, version: int) -> tuple[list[Future], list[str]]:
        """The engines' receiving calls, in flight while the weights go: vLLM's native `/update_weights` for
        the NCCL group (after its `/start_weight_update`), our extension's `molt_ipc_update` for the others."""
        calls: list[Future] = []
        if grouped:
            self._calls.round(grouped, "/start_weight_update")
            info = vllm_update_info(metas, bucket_bytes)
            calls += [self._calls.post(url, "/update_weights", {"update_info": info}) for url in grouped]
        if shared:
            assert self._channel is not None
            ipc_info = {**update_info(metas, bucket_bytes, version), "ipc_first": self._channel.posted}
            calls += [self._rpc(url, "molt_ipc_update", ipc_info) for url in shared]
        return calls, [*grouped, *shared]

    def _send_nccl(self, stream, metas: Sequence[TensorMeta], bucket_bytes: int, check) -> None:
        transfer = import_vllm_transfer()
        wire_dtypes = {m.name: dtype_from_name(m.dtype) for m in metas}
        args = {
            "group": self._group,
            "packed": True,
            "packed_buffer_size_bytes": bucket_bytes,
            "packed_num_buffers": NUM_BUFFERS,
            "post_iter_func": lambda item: self._wire_tensor(item, wire_dtypes[item[0]], check),
        }
        transfer.trainer_send_weights(stream, args)

    def _wire_tensor(self, item: tuple[str, torch.Tensor], dtype: torch.dtype, check) -> torch.Tensor:
        """The bytes vLLM receives: the announced dtype, on this GPU. An engine that already refused the
        update would leave the broadcast hanging, so check the calls before each tensor."""
        check()
        return item[1].to(device=f"cuda:{self.device_index}", dtype=dtype).contiguous()

    def close(self) -> None:
        self._drop()
        self._calls.close()

    def _drop(self) -> None:
        self._group = None
        self.urls = []
        if self._channel is not None:
            self._channel.close()
            self._channel = None


def _feeding(items: Iterator[tuple[str, torch.Tensor]], writer: SlotWriter) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of `items`, each first copied into the shared slots."""
    for name, tensor in items:
        writer.add(tensor)
        yield name, tensor
    assert writer.done(), "every bucket of the plan was posted"


def _checked(
    items: Iterator[tuple[str, torch.Tensor]], metas: Sequence[TensorMeta]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors in announced order, each checked against its metadata (a mismatch would corrupt the
    engines' weights silently: vLLM unpacks by the announced shapes)."""
    for meta in metas:
        name, tensor = next(items)
        if name != meta.name or tuple(tensor.shape) != meta.shape or not tensor.dtype.is_floating_point:
            raise ValueError(f"refit tensor {TensorMeta.of(name, tensor)} does not match its announced metadata {meta}")
        yield name, tensor
