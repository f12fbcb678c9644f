"""The vLLM scorer process (`reward_model.kind = "vllm"`): `vllm serve` as a pooling model behind our front.

vLLM 0.26 serves a `…ForSequenceClassification` directory with one label as a classify model
(`--runner pooling --convert classify`; the architecture's suffix picks the same on its own): the
causal LM with a `score` head read at the LAST token, whose `POST /classify` takes token-id lists
(its tokenizer is loaded: vLLM 0.26's scoring processor needs one; ids still go in) and answers
`data[i].probs`. It listens on
127.0.0.1; the front checks the run's token on every route (vLLM's own key covers `/v1` routes only)
and relays `/classify` with `use_activation: false` (the raw score, which `problem_type =
"regression"` in the checkpoint's config also asks for) and `/health`. vLLM dying ends this process
with 1, and the pool restarts it (`serve_vllm`, which the vLLM teacher shares).
"""

import asyncio
import contextlib
import os
import signal
import socket
from pathlib import Path

from molt_hpc.config import MoltConfig
from molt_hpc.log import get_logger, log_tail, setup_logging
from molt_hpc.rundir import RunDir
from molt_hpc.scorer.registry import Role, register_scorer, scorer_file


def vllm_score_command(cfg: MoltConfig, model_dir: str | Path, port: int, index: int) -> list[str]:
    """`vllm serve` of the reward model for scorer `index` on 127.0.0.1:`port` (the token goes in the environment)."""
    import sys

    rm = cfg.reward_model
    assert rm is not None
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--served-model-name", "reward-model"]
    cmd += ["--runner", "pooling", "--convert", "classify", "--dtype", rm.dtype]
    cmd += ["--max-model-len", str(cfg.scorer_max_len), "--gpu-memory-utilization", str(rm.gpu_memory_utilization)]
    cmd += ["--seed", str(cfg.run.seed * 1000 + 500 + index)]
    return cmd + list(rm.extra_args)


def build_score_front(front):
    """The token-checking front: `/classify` (raw scores) and `/health`, relayed to vLLM."""
    from aiohttp import web

    from molt_hpc.engine.vllm.front import call_upstream, relay, upstream_message
    from molt_hpc.protocol.edge import error, errors_middleware, parse, read_json, token_middleware
    from molt_hpc.scorer.request import ClassifyRequest

    app = web.Application(middlewares=[token_middleware(front.token), errors_middleware], client_max_size=1 << 28)

    async def open_session(_app) -> None:
        import aiohttp

        front.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))

    async def close_session(_app) -> None:
        if front.session is not None:
            await front.session.close()

    async def classify(request: web.Request) -> web.Response:
        req = parse(ClassifyRequest, await read_json(request), "the body (with 'input': a list of token-id lists)")
        body = {"input": req.sequences, "use_activation": bool(req.use_activation)}
        return relay(*await call_upstream(front, "POST", "/classify", json=body))

    async def health(request: web.Request) -> web.Response:
        import aiohttp

        status, raw, _ = await call_upstream(front, "GET", "/health", timeout=aiohttp.ClientTimeout(total=10.0))
        if status != 200:
            return error(503, f"vLLM at {front.upstream} is not healthy (HTTP {status}): {upstream_message(raw)}")
        return web.json_response({"status": "ok", "index": front.index, "kind": "vllm"})

    app.on_startup.append(open_session)
    app.on_cleanup.append(close_session)
    app.add_routes([web.post("/classify", classify), web.get("/health", health)])
    return app


async def serve_vllm(cfg: MoltConfig, run: RunDir, index: int, role: Role, cmd_of, build_front) -> int:
    """Start `vllm serve` (`cmd_of(port)`, on 127.0.0.1), wait until it is healthy, then serve
    `build_front(Front)` on `engines.host` registered as `role` `index` until SIGTERM (0) or vLLM dies (1);
    what the vLLM scorer and the vLLM teacher share."""
    from aiohttp import web

    from molt_hpc.engine.main import public_url
    from molt_hpc.engine.vllm.front import Front
    from molt_hpc.engine.vllm.main import start_vllm, stop_vllm, vllm_env, wait_healthy
    from molt_hpc.net import free_port

    log = get_logger()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    port = free_port("127.0.0.1")
    upstream, vlog = f"http://127.0.0.1:{port}", run.logs / f"vllm-{role}-{index}.log"
    proc = start_vllm(cmd_of(port), vllm_env(run.token()), vlog)
    log.info("started vLLM (pid %d) as %s %d on %s, log %s", proc.pid, role, index, upstream, vlog)
    try:
        if not await wait_healthy(proc, upstream, vlog, cfg.engines.startup_timeout_s, stop):
            return 0
        runner = web.AppRunner(build_front(Front(upstream, run.token(), index)), handler_cancellation=True,
                               access_log=None)  # fmt: skip
        await runner.setup()
        sock = socket.create_server((cfg.engines.host, 0))
        await web.SockSite(runner, sock).start()
        register_scorer(run, index, public_url(cfg.engines.host, sock.getsockname()[1]), "vllm", role)
        log.info("vLLM %s ready", role)
        try:
            while not stop.is_set():
                if proc.poll() is not None:
                    log.error("vLLM exited with %s while serving; end of its log:\n%s", proc.returncode, log_tail(vlog))
                    return 1
                with contextlib.suppress(TimeoutError):  # a second passed: look at vLLM again
                    await asyncio.wait_for(stop.wait(), 1.0)
            return 0
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(scorer_file(run, index, role))
            await runner.cleanup()
    finally:
        log.info("vLLM stopped (exit %s)", stop_vllm(proc))


async def serve(cfg: MoltConfig, run: RunDir, index: int) -> int:
    from molt_hpc.engine.vllm.main import check_vllm
    from molt_hpc.models.reward import resolve_reward_model

    rm = cfg.reward_model
    assert rm is not None
    version = check_vllm()  # before anything slow: a missing vLLM fails in seconds
    model_dir = resolve_reward_model(rm)
    get_logger().info("vLLM %s scores with %s", version, model_dir)
    return await serve_vllm(cfg, run, index, "scorer", lambda port: vllm_score_command(cfg, model_dir, port, index),
                            build_score_front)  # fmt: skip


def main(cfg: MoltConfig, run_dir: str | Path, index: int) -> int:
    setup_logging(f"scorer {index}", cfg.logging.level)
    return asyncio.run(serve(cfg, RunDir(Path(run_dir)), index))
