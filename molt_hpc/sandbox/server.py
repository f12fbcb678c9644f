"""The sandbox server process: `POST /run` executes untrusted code in a bounded pool of confined processes.

Loopback only in a local-mode run; in a Slurm job it runs on the CPU node of its own het group and listens
on every interface for the engine pool's envs. The run's token on every route. `sandbox.workers` slots run
executions; up to `sandbox.max_queue` more wait for a slot, and a request past that is answered 429 with
`Retry-After` (the client waits and sends it again). A slot is a number, not a process: each execution
is a fresh confined `python3` (`execute.py`), so whatever the code does ends with it and the pool keeps
its size. A request whose client goes away cancels its execution (its process tree is killed).
"""

import asyncio
import json
import os
import socket
from pathlib import Path

from aiohttp import web
from pydantic import ValidationError

from molt_hpc.config import MoltConfig
from molt_hpc.config.sandbox import SandboxConfig
from molt_hpc.log import get_logger, setup_logging
from molt_hpc.net import loopback_only, public_host, serve_until_signal
from molt_hpc.protocol.edge import error, errors_middleware, read_json, token_middleware
from molt_hpc.rundir import RunDir, atomic_write
from molt_hpc.sandbox import isolation, sandbox_file
from molt_hpc.sandbox.execute import execute
from molt_hpc.sandbox.protocol import MAX_BODY_BYTES, RunRequest


class Pool:
    """The worker slots, the waiting room and the counters `/health` reports."""

    def __init__(self, cfg: SandboxConfig, mode: str):
        self.cfg, self.mode = cfg, mode
        self.users = isolation.claim_users(cfg.workers)
        self.free: asyncio.Queue[int | None] = asyncio.Queue()  # the idle slots, by the user id they run as
        for user in self.users:
            self.free.put_nowait(user)
        self.waiting = self.running = self.executions = 0

    def health(self) -> dict:
        return {
            "status": "ok", "isolation": self.mode, "workers": self.cfg.workers,
            "live_workers": self.free.qsize() + self.running, "queued": self.waiting, "running": self.running,
            "executions": self.executions, "users": self.users,
        }  # fmt: skip

    async def run(self, req: RunRequest):
        """The result of `req`, or None when the waiting room is full."""
        if self.waiting >= self.cfg.max_queue and self.free.empty():
            return None
        self.waiting += 1
        try:
            user = await self.free.get()
        finally:
            self.waiting -= 1
        self.running += 1
        try:
            return await execute(self.cfg, self.mode, req, user)
        finally:
            self.running -= 1
            self.executions += 1
            self.free.put_nowait(user)


def build_app(pool: Pool, token: str) -> web.Application:
    app = web.Application(middlewares=[token_middleware(token), errors_middleware], client_max_size=MAX_BODY_BYTES)

    async def run(request: web.Request) -> web.Response:
        try:
            req = RunRequest.model_validate(await read_json(request))
        except ValidationError as err:
            raise ValueError(f"bad /run body: {err.errors(include_url=False)}") from None
        result = await pool.run(req)
        if result is None:
            response = error(429, f"the sandbox queue is full ({pool.cfg.max_queue} waiting): retry")
            response.headers["Retry-After"] = "1"
            return response
        return web.json_response(result.model_dump())

    async def health(request: web.Request) -> web.Response:
        return web.json_response(pool.health())

    app.add_routes([web.post("/run", run), web.get("/health", health)])
    return app


async def serve(cfg: SandboxConfig, run: RunDir) -> None:
    log = get_logger()
    mode = isolation.choose(cfg)
    isolation.become_subreaper()
    runner = web.AppRunner(build_app(Pool(cfg, mode), run.token()), handler_cancellation=True, access_log=None)
    await runner.setup()
    host = "127.0.0.1" if loopback_only() else "0.0.0.0"  # a Slurm job: envs reach it from the engine nodes
    sock = socket.create_server((host, 0))
    await web.SockSite(runner, sock).start()
    url = f"http://{public_host(host)}:{sock.getsockname()[1]}"
    atomic_write(sandbox_file(run), json.dumps({"url": url, "pid": os.getpid(), "isolation": mode}), durable=False)
    log.info("sandbox at %s: %s isolation, %d workers, queue %d", url, mode, cfg.workers, cfg.max_queue)
    await serve_until_signal(runner, sandbox_file(run), log)


def main(cfg: MoltConfig, run_dir: str | Path) -> int:
    setup_logging("sandbox", cfg.logging.level)
    if cfg.sandbox is None:
        raise ValueError("this run has no [sandbox] section; add one to run the sandbox server")
    asyncio.run(serve(cfg.sandbox, RunDir(Path(run_dir).absolute())))
    return 0
