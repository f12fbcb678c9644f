"""The engine's weight-transfer routes (vLLM's names): init → start → update → finish.

`start` pauses the scheduler at a step boundary; `update` receives the buckets in a worker thread
(the HTTP server keeps answering) straight into the live parameters, which is safe because no step
runs until `finish`; `finish` bumps the version, drops the KV cache and resumes. Loading in place
means a failed transfer leaves torn weights: then `finish` is refused (409) and the engine stays
paused until a complete update arrives, so no token is ever sampled from a mix of two policies.
`update` may also carry `start` and `finish_version` (`BuiltinUpdateRequest`): one call does all three, which
a trainer sending through shared memory uses, since no broadcast group waits for every engine to pause.
"""

import asyncio
import contextlib
import time
from collections.abc import Callable

import torch
from aiohttp import web

from molt_hpc.engine.lora import AdapterLayers, AdapterMerge
from molt_hpc.engine.server import EngineState, run_on_scheduler
from molt_hpc.log import get_logger
from molt_hpc.protocol.edge import error, parse, read_json
from molt_hpc.protocol.requests import BuiltinUpdateRequest, FinishRequest, InitRequest
from molt_hpc.refit.buckets import metas_from_info
from molt_hpc.refit.experts import expert_views
from molt_hpc.refit.receiver import RefitReceiver


class WeightSync:
    """Refit state of one engine: idle → started → (loading → loaded | torn) → idle."""

    def __init__(
        self,
        state: EngineState,
        model: torch.nn.Module,
        on_version: Callable[[int], None] | None = None,
        lora_only: bool = False,
        lora_layers: float | None = None,
    ):
        self.state = state
        self.receiver = RefitReceiver()
        # keep_vars: the live Parameters, tied weights under both of their names; fused MoE experts also
        # under their per-expert HF names (views), as expert-parallel trainers send them
        self.params = {**model.state_dict(keep_vars=True), **expert_views(model)}
        self.phase = "idle"
        self.on_version = on_version
        self.lora = AdapterMerge(self.params) if lora_layers is None else AdapterLayers(self.params, lora_layers)
        """Where a LoRA refit's adapters go: merged into the weights, or into the model's own LoRA layers (their
        scaling `lora_layers`, `actor.lora.engine_weights = 'separate'`)."""
        self.lora_only = lora_only
        """A LoRA run's engine: refits bring adapters (`update_info.lora_scaling`); a base change is refused."""

    def add_routes(self, app: web.Application) -> None:
        app.add_routes(
            [
                web.post("/init_weight_transfer_engine", self.init),
                web.post("/start_weight_update", self.start),
                web.post("/update_weights", self.update),
                web.post("/finish_weight_update", self.finish),
            ]
        )

    async def init(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        parse(InitRequest, body)  # refused here, before the live channel is touched
        return web.json_response(await asyncio.to_thread(self.receiver.init, body["init_info"]))

    async def start(self, request: web.Request) -> web.Response:
        await read_json(request)  # a body, if any, must at least be JSON: a malformed one pauses nothing
        return web.json_response(await self._begin())

    async def _begin(self) -> dict:
        status = await run_on_scheduler(self.state, self.state.scheduler.begin_refit)
        if self.phase != "torn":
            self.phase = "started"
        return status

    async def update(self, request: web.Request) -> web.Response:
        req = parse(BuiltinUpdateRequest, await read_json(request))
        if req.start:  # start, update and finish in one call (a shared-memory refit)
            await self._begin()
        answer = await self._update(req.update_info)
        if not isinstance(answer, dict):  # refused: the engine stays as it was (paused when it started here)
            return answer
        if req.finish_version is not None:
            answer["finish"] = await self._end(req.finish_version)
        return web.json_response(answer)

    async def _update(self, info: dict) -> dict | web.Response:
        if self.phase not in ("started", "loaded", "torn"):
            return error(409, "call /start_weight_update before /update_weights")
        before, self.phase = self.phase, "loading"
        t0 = time.perf_counter()
        try:
            loaded = await asyncio.to_thread(self._receive, info)
        except ValueError:  # refused before anything was loaded (the buckets were drained)
            self.phase = before
            raise
        except Exception:
            self.phase = "torn"
            raise
        self.phase = "loaded"
        return {"loaded": loaded, "seconds": time.perf_counter() - t0}

    def _receive(self, info: dict) -> int:
        """Receive one update: full weights into the live parameters, or adapters (`engine.lora`)."""
        scaling = info.get("lora_scaling")
        if scaling is None:
            if self.lora_only:
                self._drain(info)
                raise ValueError(
                    "this engine serves a LoRA run ([actor.lora]): its refits bring adapters only, and a refit "
                    "that changes the base weights is refused"
                )
            return self.receiver.receive(info, self.params)
        metas = metas_from_info(info)
        if not isinstance(scaling, int | float) or isinstance(scaling, bool):
            problem = f"update_info.lora_scaling must be a number (alpha / rank), got {scaling!r}"
        else:
            problem = self.lora.check(metas, float(scaling))
        if problem is not None:
            self._drain(info)
            raise ValueError(problem)
        loaded = self.receiver.receive(info, self.lora.buffers(metas))
        self.lora.apply(float(scaling))
        return loaded

    def _drain(self, info: dict) -> None:
        """Take a refused update's buckets off the wire (into nothing), so the sender and the other engines
        stay in step; the receiver refuses names this (empty) target lacks."""
        with contextlib.suppress(ValueError):
            self.receiver.receive(info, {})

    async def finish(self, request: web.Request) -> web.Response:
        version = parse(FinishRequest, await read_json(request)).chosen
        sched = self.state.scheduler
        if version is None:
            version = sched.version + 1
        if self.phase == "torn":
            return error(409, "the last weight update failed part-way; push a complete update before finishing")
        if self.phase == "loading":
            return error(409, "a weight update is still being received")
        return web.json_response(await self._end(version))

    async def _end(self, version: int) -> dict:
        sched = self.state.scheduler
        status = await run_on_scheduler(self.state, lambda: sched.end_refit(version))
        self.phase = "idle"
        get_logger().info("weights updated to version %d", version)
        if self.on_version is not None:
            self.on_version(version)
        return status
