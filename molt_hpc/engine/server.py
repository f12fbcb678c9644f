"""The engine's aiohttp app: the token check, request validation, generate and the control routes.

Handlers never run the model: they validate, hand work to the scheduler thread and await its
future, so a slow step never blocks `/health` and a bad request never reaches the model. A client
that disconnects cancels its request (the row leaves the batch at the next step boundary). With
`stream: true` the answer is server-sent events: the tokens of every step as it ends, then the whole
answer, so nothing an engine sampled is lost with it.
"""

import asyncio
import itertools
import json
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from molt_hpc.engine.batch import Row
from molt_hpc.engine.sampling import parse_generate
from molt_hpc.engine.scheduler import Scheduler
from molt_hpc.engine.vision import ImageCache, check_no_pads
from molt_hpc.protocol.edge import errors_middleware, parse, read_json, send, token_middleware
from molt_hpc.protocol.requests import PAUSE_MODES, PauseRequest, ResumeRequest


@dataclass
class EngineState:
    """What the handlers need: the scheduler and the request limits."""

    scheduler: Scheduler
    vocab_size: int
    max_model_len: int
    model_name: str
    index: int = 0
    vision: Any = None
    """The model's `molt_hpc.vision.processor.Vision` (a vision-language model), else None."""
    place: dict[str, Any] = field(default_factory=dict)
    """Where the weights live (`refit.handles.place`): `/health` tells the trainer, which picks the refit transport."""
    images: ImageCache = field(init=False)
    """The checked images of recent requests."""

    def __post_init__(self) -> None:
        self.images = ImageCache(self.vision)


def logprob_content(row: Row) -> list[dict[str, Any]]:
    """vLLM's `logprobs.content`: the sampled token's log-prob, plus `top_logprobs` when asked for."""
    content: list[dict[str, Any]] = [
        {"token_id": t, "logprob": lp} for t, lp in zip(row.tokens, row.logprobs, strict=True)
    ]
    for entry, top in zip(content, row.top, strict=False):
        entry["top_logprobs"] = [{"token_id": t, "logprob": lp} for t, lp in top]
    return content


async def run_on_scheduler(state: EngineState, fn) -> Any:
    return await asyncio.wrap_future(state.scheduler.call(fn))


STATE = web.AppKey("state", EngineState)
IDS = web.AppKey("ids", itertools.count)


def build_app(state: EngineState, token: str, open_health: bool = False) -> web.Application:
    """The engine's routes; `open_health`: see `token_middleware`. Handlers read the state from the app."""
    middlewares = [token_middleware(token, open_health), errors_middleware]
    app = web.Application(middlewares=middlewares, client_max_size=1 << 30)
    app[STATE], app[IDS] = state, itertools.count()
    app.on_startup.append(bind_loop)
    app.add_routes(
        [
            web.post("/inference/v1/generate", generate),
            web.get("/health", health),
            web.post("/pause", pause),
            web.post("/resume", resume),
            web.get("/is_paused", is_paused),
            web.get("/v1/models", models),
        ]
    )
    return app


async def bind_loop(app: web.Application) -> None:
    """Streamed rows are woken on this app's event loop: one thread-safe hand-over per engine step."""
    loop = asyncio.get_running_loop()
    app[STATE].scheduler.on_tokens = lambda rows: loop.call_soon_threadsafe(notify_rows, rows)


def notify_rows(rows: list[Row]) -> None:
    for row in rows:
        row.notify()


async def generate(request: web.Request) -> web.Response:
    state = request.app[STATE]
    sched = state.scheduler
    req = parse_generate(await read_json(request), state.vocab_size, state.max_model_len)
    row = Row(prompt=list(req.token_ids), params=req.sampling_params, future=Future())
    if req.mm is not None:  # decoding and measuring images is CPU work: off the event loop
        row.images = await asyncio.to_thread(state.images.get, req.mm, row.prompt)
        row.rope_delta = row.images.rope_delta
    elif state.vision is not None:
        check_no_pads(row.prompt, state.vision)
    rid = req.request_id or f"gen-{state.index}-{next(request.app[IDS])}"
    if req.stream:
        return await stream_answer(request, state, row, rid)
    await run_on_scheduler(state, lambda: sched.submit(row))
    try:
        reason, version = await asyncio.wrap_future(row.future)
    except asyncio.CancelledError:  # the client left: free the row's slot, then let aiohttp finish
        sched.call(lambda: sched.cancel(row))
        raise
    return web.json_response(answer(row, reason, version, rid))


def answer(row: Row, reason: str, version: int, rid: str) -> dict[str, Any]:
    """The generate answer of a finished row (vLLM's shape plus per-token weight versions)."""
    choice = {
        "index": 0,
        "token_ids": row.tokens,
        "logprobs": {"content": logprob_content(row)},
        "finish_reason": reason,
        "weight_versions": row.versions,
    }
    if row.routing is not None:  # vLLM's --enable-return-routed-experts field
        start = row.params.routed_experts_prompt_start
        choice["routed_experts"] = row.routing.encode(start) if row.tokens else None
    return {"id": rid, "choices": [choice], "weight_version": version}


def sse(data: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(data).encode() + b"\n\n"


async def stream_answer(request: web.Request, state: EngineState, row: Row, rid: str) -> web.StreamResponse:
    """`stream: true`: server-sent events, one per step with the tokens it added (`token_ids`, `logprobs`,
    `weight_versions`), then the whole answer; an engine that dies mid-request has handed out every token it
    sampled, so the client continues the request elsewhere from them (`molt_hpc.rollout.resume`)."""
    sched, moved = state.scheduler, asyncio.Event()
    row.notify = moved.set  # on this loop, after each step (`bind_loop`)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    await run_on_scheduler(state, lambda: sched.submit(row))
    done, sent = asyncio.wrap_future(row.future), 0
    done.add_done_callback(lambda _: moved.set())
    try:
        while not done.done():
            await moved.wait()
            moved.clear()
            # The scheduler thread appends tokens, log-probs, then versions: the shortest list is whole.
            n = min(len(row.tokens), len(row.logprobs), len(row.versions))
            if n > sent and not done.done():
                delta = {"token_ids": row.tokens[sent:n], "logprobs": row.logprobs[sent:n],
                         "weight_versions": row.versions[sent:n]}  # fmt: skip
                if not await send(resp, sse(delta)):  # the client left: free the row's slot
                    sched.call(lambda: sched.cancel(row))
                    return resp
                sent = n
        try:
            final = answer(row, *done.result(), rid)
        except RuntimeError as err:  # a failed engine step: the status line is gone, so an error event
            final = {"error": str(err)}
        await send(resp, sse(final), end=True)
    except asyncio.CancelledError:  # the client left while the handler waited: free the row's slot
        sched.call(lambda: sched.cancel(row))
        raise
    return resp


async def health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return web.json_response({"status": "ok", "index": state.index, **state.place, **state.scheduler.status()})


async def pause(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = parse(PauseRequest, await read_json(request))
    mode = request.query.get("mode") or body.mode or "abort"
    if mode not in PAUSE_MODES:
        raise ValueError(f"pause mode {mode!r} is not one of {', '.join(PAUSE_MODES)}")
    done: Future = Future()
    await run_on_scheduler(state, lambda: state.scheduler.pause(mode, done))
    return web.json_response({"mode": mode, **(await asyncio.wrap_future(done))})


async def resume(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = parse(ResumeRequest, await read_json(request))  # a malformed body resumes nothing
    return web.json_response(await run_on_scheduler(state, lambda: state.scheduler.resume(body.steps)))


async def is_paused(request: web.Request) -> web.Response:
    return web.json_response({"is_paused": request.app[STATE].scheduler.pause_mode is not None})


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    entry = {"id": state.model_name, "object": "model", "owned_by": "molt-hpc", "max_model_len": state.max_model_len}
    return web.json_response({"object": "list", "data": [entry]})
