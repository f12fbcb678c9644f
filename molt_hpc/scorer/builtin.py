"""The built-in scorer process (`reward_model.kind = "builtin"`): a transformers reward model behind
the classify route, on the CPU or a GPU.

Requests are validated in the handler (token ids within the vocabulary and `reward_model.max_model_len`)
and scored one forward of up to `reward_model.max_batch` sequences at a time in a worker thread, so
`/health` answers while a batch runs. A score is the head's output at the sequence's last token
(`molt_hpc.models.reward`), exactly as `molt-hpc rm train` trained it.
"""

import asyncio
import os
import socket
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from molt_hpc.config import MoltConfig
from molt_hpc.log import get_logger, setup_logging
from molt_hpc.net import serve_until_signal
from molt_hpc.protocol.edge import parse
from molt_hpc.rundir import RunDir
from molt_hpc.scorer.registry import Role, register_scorer, scorer_file
from molt_hpc.scorer.request import ClassifyRequest


def parse_classify(body: Any, vocab_size: int, max_len: int) -> tuple[list[list[int]], bool]:
    """(sequences, whether to apply the sigmoid) of a classify request; a `ValueError` (→ 400) says what is wrong."""
    req = parse(ClassifyRequest, body, "the body (with 'input': a list of token-id lists)")
    seqs = req.sequences
    for i, s in enumerate(seqs):
        if len(s) > max_len:
            limit = f"the scorer's {max_len} (reward_model.max_model_len)"
            raise ValueError(f"input[{i}] has {len(s)} tokens, over {limit}")
        if min(s) < 0 or max(s) >= vocab_size:
            raise ValueError(f"input[{i}] has a token id outside the vocabulary (0..{vocab_size - 1})")
    return seqs, bool(req.use_activation)


def build_app(model, token: str, index: int, max_batch: int, max_len: int, name: str):
    from aiohttp import web

    from molt_hpc.models.reward import score_sequences
    from molt_hpc.protocol.edge import errors_middleware, read_json, token_middleware

    app = web.Application(middlewares=[token_middleware(token), errors_middleware], client_max_size=1 << 28)
    worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="score")  # one forward at a time
    vocab = model.config.vocab_size

    async def classify(request: web.Request) -> web.Response:
        seqs, activation = parse_classify(await read_json(request), vocab, max_len)
        scores = await asyncio.get_running_loop().run_in_executor(worker, score_sequences, model, seqs, max_batch)
        if activation:
            import math

            scores = [1.0 / (1.0 + math.exp(-s)) for s in scores]
        data = [{"index": i, "label": None, "probs": [s], "num_classes": 1} for i, s in enumerate(scores)]
        return web.json_response({"object": "list", "model": name, "data": data})

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "index": index, "kind": "builtin"})

    async def close(_app) -> None:
        worker.shutdown(wait=False, cancel_futures=True)

    app.on_cleanup.append(close)
    app.add_routes([web.post("/classify", classify), web.get("/health", health)])
    return app


async def listen(cfg: MoltConfig, run: RunDir, index: int, app, role: Role = "scorer") -> str:
    """Serve `app` on `engines.host` (a free port) and register it as `role` `index` of the run until SIGTERM;
    what the built-in scorer and the teacher share. Returns once the server stopped."""
    from aiohttp import web

    from molt_hpc.engine.main import public_url

    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    sock = socket.create_server((cfg.engines.host, 0))  # port 0: the kernel picks a free one
    await web.SockSite(runner, sock).start()
    url = public_url(cfg.engines.host, sock.getsockname()[1])
    register_scorer(run, index, url, "builtin", role)
    get_logger().info("%s %d listens at %s", role, index, url)
    await serve_until_signal(runner, scorer_file(run, index, role), get_logger())
    return url


async def serve(cfg: MoltConfig, run: RunDir, index: int) -> None:
    from molt_hpc.engine.main import pick_device
    from molt_hpc.models.reward import load_reward_model, resolve_reward_model

    rm = cfg.reward_model
    assert rm is not None
    path = resolve_reward_model(rm)
    device = pick_device(rm.device)
    model = load_reward_model(path, dtype=rm.dtype, device=device, attn=cfg.model.attn_implementation).eval()
    get_logger().info("scoring with %s on %s", path, device)
    await listen(cfg, run, index, build_app(model, run.token(), index, rm.max_batch, cfg.scorer_max_len, rm.path))


def main(cfg: MoltConfig, run_dir: str | Path, index: int, role: Role = "scorer", serve=serve) -> int:
    """Run `serve(cfg, run, index)` (the built-in scorer's, or the teacher's) in a process of its own."""
    setup_logging(f"{role} {index}", cfg.logging.level)
    import torch

    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    asyncio.run(serve(cfg, RunDir(Path(run_dir)), index))
    return 0
