"""The router process: proxy `/inference/v1/generate` and `/v1/*` to the engine a session belongs to.

Requests are checked at the edge (`checked_body`); bodies and answers then pass through unchanged
(server-sent events are streamed chunk by chunk); the answer carries `X-Molt-Engine: <index>`. A request
whose connection to an engine fails before any answer byte was sent is retried on the next engine (up to
`router.connect_retries` engines) and the failed engine leaves the ring; a streamed answer that breaks
midway is cut for the client too (who continues it elsewhere from the tokens it got) and its engine
leaves the ring. `/pause`, `/resume` and the weight
routes are not routed: the refit talks to the engines directly. Registers as `rendezvous/router.json`.
"""

import asyncio
import contextlib
import json
import os
import signal
import socket
from pathlib import Path

import aiohttp
from aiohttp import web

from molt_hpc.config import MoltConfig
from molt_hpc.engine.client import SESSION_HEADER
from molt_hpc.log import get_logger, setup_logging
from molt_hpc.net import public_host
from molt_hpc.protocol.edge import (
    check_session,
    error,
    errors_middleware,
    forwardable_path,
    loads,
    parse,
    read_body,
    send,
    token_middleware,
)
from molt_hpc.protocol.requests import GenerateRequest
from molt_hpc.router.pool import Engine, EnginePool
from molt_hpc.rundir import RunDir, atomic_write

FORWARD_HEADERS = ("Authorization", "Content-Type", "Accept", SESSION_HEADER)
ENGINE_HEADER = "X-Molt-Engine"
GENERATE_PATH = "/inference/v1/generate"


async def forward(
    request: web.Request, engine: Engine, body: bytes, client: aiohttp.ClientSession, started: list[bool]
) -> web.StreamResponse:
    """Send the request to `engine` and stream its answer back; `started[0]` turns True once the
    client got the status line (from then on a failure cannot be retried elsewhere)."""
    headers = {k: request.headers[k] for k in FORWARD_HEADERS if k in request.headers}
    async with client.request(request.method, engine.url + request.path_qs, data=body, headers=headers) as up:
        out_headers = {ENGINE_HEADER: str(engine.index)}
        if "Content-Type" in up.headers:
            out_headers["Content-Type"] = up.headers["Content-Type"]
        if up.content_type != "text/event-stream":  # a whole answer: one read, one write
            payload = await up.read()
            return web.Response(status=up.status, body=payload, headers=out_headers)
        resp = web.StreamResponse(status=up.status, headers=out_headers)
        started[0] = True
        await resp.prepare(request)
        chunks = up.content.iter_any()
        while True:
            try:
                chunk = await anext(chunks)
            except StopAsyncIteration:
                break
            except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as err:  # the engine, not the client
                raise CutAnswer(resp, err) from err
            if not await send(resp, chunk):
                return resp
        await send(resp, end=True)
        return resp


class CutAnswer(Exception):
    """The engine's streamed answer broke after the client got part of it."""

    def __init__(self, response: web.StreamResponse, cause: BaseException):
        super().__init__(str(cause))
        self.response = response
        self.cause = cause


async def checked_body(request: web.Request) -> bytes:
    """The body to forward, once the request passed the edge checks (a `BadRequest` → 400 otherwise):
    a plain `/v1/` path (nothing an engine would normalise into one of its control routes), a JSON
    body that is UTF-8 with finite numbers, and for generate the protocol's typed request."""
    if request.path != GENERATE_PATH:
        forwardable_path(request, "/v1/")
    body = await read_body(request)
    if body or request.path == GENERATE_PATH:
        decoded = loads(body)
        if request.path == GENERATE_PATH:
            parse(GenerateRequest, decoded, "the generate body")
    return body


POOL = web.AppKey("pool", EnginePool)
RETRIES = web.AppKey("retries", int)
CLIENT = web.AppKey("client", aiohttp.ClientSession)
STATS = web.AppKey("stats", dict)


def build_app(pool: EnginePool, cfg: MoltConfig, token: str) -> web.Application:
    """The router's routes; handlers read the engine pool, its HTTP client and the counters from the app."""
    app = web.Application(middlewares=[token_middleware(token), errors_middleware], client_max_size=1 << 30)
    app[POOL], app[RETRIES], app[STATS] = pool, cfg.router.connect_retries, {"retries": 0, "unrouted": 0}
    app.add_routes(
        [
            web.post(GENERATE_PATH, proxy),
            web.route("*", "/v1/{tail:.*}", proxy),
            web.get("/health", health),
            web.get("/metrics", metrics),
        ]
    )
    app.cleanup_ctx.append(lifecycle)
    return app


async def lifecycle(app: web.Application):
    """The router's HTTP client and the engines' health loop, for the app's life."""
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as client:
        app[CLIENT] = client
        await app[POOL].refresh(client)
        task = asyncio.create_task(app[POOL].run_forever(client))
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):  # the health loop ends with the router
            await task


async def proxy(request: web.Request) -> web.StreamResponse:
    """Forward a request to the session's engine; on a connection error before any answer, the next one."""
    app = request.app
    pool, stats = app[POOL], app[STATS]
    body = await checked_body(request)
    session_id = check_session(request.headers.get(SESSION_HEADER))
    tried: set[int] = set()
    last = "no healthy engine"
    for _ in range(app[RETRIES]):
        engine = pool.pick(session_id, tried)
        if engine is None:
            break
        tried.add(engine.index)
        engine.in_flight += 1
        engine.total += 1
        started = [False]
        try:
            return await forward(request, engine, body, app[CLIENT], started)
        except CutAnswer as cut:
            pool.mark_failed(engine, f"failed mid-answer: {cut.cause}")
            if request.transport is not None:  # cut the client's answer too, at once (no closing chunk): it
                request.transport.close()  # continues the request elsewhere from the tokens it was streamed
            return cut.response
        except aiohttp.ClientConnectionError as err:
            if started[0]:  # the client left mid-answer
                raise
            # nothing reached the client yet: take the engine out and try the next one
            last = f"engine {engine.index}: {type(err).__name__}: {err}"
            pool.mark_failed(engine, last)
            stats["retries"] += 1
        finally:
            engine.in_flight -= 1
    stats["unrouted"] += 1
    return error(503, f"no engine could take the request ({last}); retry later")


async def health(request: web.Request) -> web.Response:
    m = request.app[POOL].metrics()
    return web.json_response({"status": "ok" if m["healthy"] else "no engines", "engines": m["healthy"]})


async def metrics(request: web.Request) -> web.Response:
    return web.json_response({**request.app[POOL].metrics(), **request.app[STATS]})


async def serve(cfg: MoltConfig, run: RunDir) -> None:
    log = get_logger()
    token = run.token()
    pool = EnginePool(run, cfg.router, token)
    runner = web.AppRunner(build_app(pool, cfg, token), access_log=None)
    await runner.setup()
    sock = socket.create_server((cfg.engines.host, 0))  # port 0: the kernel picks a free one
    await web.SockSite(runner, sock).start()
    url = f"http://{public_host(cfg.engines.host)}:{sock.getsockname()[1]}"
    record = run.rendezvous / "router.json"
    atomic_write(record, json.dumps({"url": url, "pid": os.getpid()}))
    log.info("routing to %d engine(s) at %s", pool.metrics()["healthy"], url)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    with contextlib.suppress(FileNotFoundError):  # already removed: nothing to unregister
        os.unlink(record)
    await runner.cleanup()


def main(cfg: MoltConfig, run_dir: str | Path) -> int:
    """Run the router of the run in `run_dir` until SIGTERM."""
    if cfg.router.kind == "vllm-router":
        from molt_hpc.router import vllm_router

        return vllm_router.main(cfg, run_dir)
    setup_logging("router", cfg.logging.level)
    asyncio.run(serve(cfg, RunDir(Path(run_dir))))
    return 0
