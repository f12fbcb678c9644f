"""The engine process: load the model, start the scheduler and the HTTP server, register, serve.

Registration is `RUN_DIR/rendezvous/engine-<index>.json` = `{"url", "index", "pid", "version", "kind"}`,
written atomically once the server listens (the port comes from the kernel) and again after each
weight update. A clean stop (SIGTERM/SIGINT) removes it, so the router drops the engine at once, and ends the requests
in flight as `abort` with their tokens (their clients continue them elsewhere);
after a crash the router's health checks take it out of the ring.
"""

import asyncio
import functools
import json
import os
import socket
from pathlib import Path

from molt_hpc.config import MoltConfig
from molt_hpc.log import get_logger, setup_logging
from molt_hpc.net import public_host, serve_until_signal
from molt_hpc.rundir import RunDir, atomic_write


def pick_device(setting: str) -> str:
    import torch

    if setting == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if setting == "cuda" and not torch.cuda.is_available():
        raise ValueError("engines.device = 'cuda' but no GPU is visible; use 'cpu' or 'auto'")
    return setting


def public_url(host: str, port: int) -> str:
    return f"http://{public_host(host)}:{port}"


def engine_file(run: RunDir, index: int) -> Path:
    return run.rendezvous / f"engine-{index}.json"


def register_engine(run: RunDir, index: int, url: str, version: int, kind: str) -> None:
    """Write (atomically) the registration the router, the trainer and the launcher read."""
    record = {"url": url, "index": index, "pid": os.getpid(), "version": version, "kind": kind}
    atomic_write(engine_file(run, index), json.dumps(record), durable=False)  # rewritten at every refit


def model_runner(model, dev, eng, vision, *, graphs: bool):
    """The runner of the engine's forwards; `graphs=False` keeps decode steps out of CUDA graphs (the router
    hooks of router replay record from Python)."""
    from molt_hpc.engine.batch import ModelRunner
    from molt_hpc.engine.slots import ATTENTION, SlotRunner, check_slot_cache_fits
    from molt_hpc.engine.vision import VisionRunner
    from molt_hpc.models.exact import is_exact

    # exact slot forwards (`engine.exact_slots`) keep the trainer's projections, the eager step and the one sampler
    exact = is_exact(model)
    if vision is not None:  # multimodal positions: the growing cache (the slot cache's columns are positions)
        return VisionRunner(model, dev, vision.spec.merge)
    if dev.type == "cuda" and (exact or getattr(model.config, "_attn_implementation", "sdpa") in ATTENTION):
        # On a GPU: a preallocated KV cache, and decode steps replayed as CUDA graphs unless enforce_eager.
        # On a CPU the step costs what its ops cost either way; the growing cache stays.
        # Router replay (graphs=False here) reads the plain prefill's left-padded rows: it keeps that prefill.
        slot_prefill = graphs
        graphs = graphs and not eng.enforce_eager
        fraction = eng.gpu_memory_utilization
        check_slot_cache_fits(model.config, dev, eng.max_batch, eng.max_model_len, model.dtype, fraction)
        return SlotRunner(
            model,
            dev,
            max_batch=eng.max_batch,
            max_model_len=eng.max_model_len,
            graphs=graphs,
            sampling=eng.sample_in_graph and not exact,
            fuse=eng.fuse_projections and not exact,
            # router replay (graphs=False) records from Python hooks, which a compiled step would trace away
            compile="inductor" if eng.compile_decode and graphs and not exact else None,
            slot_prefill=slot_prefill,
        )
    return ModelRunner(model, dev)


def build_engine(cfg: MoltConfig, run: RunDir, index: int, model=None):
    """Model, scheduler and app of engine `index` (not yet serving); `model` skips loading it from
    `model.path` (a model built in memory, e.g. by a benchmark)."""
    import torch

    from molt_hpc.engine.routing import RoutingRecorder
    from molt_hpc.engine.scheduler import Scheduler
    from molt_hpc.engine.server import EngineState, build_app
    from molt_hpc.engine.slots import bound_gpu_memory
    from molt_hpc.engine.weights import WeightSync
    from molt_hpc.models import load_causal_lm, resolve_model
    from molt_hpc.refit.handles import place
    from molt_hpc.vision.processor import Vision

    if cfg.engines.kind != "builtin":
        raise ValueError(f"engines.kind = {cfg.engines.kind!r}: this process runs the builtin engine only")
    if cfg.engines.threads:
        torch.set_num_threads(cfg.engines.threads)
    device = pick_device(cfg.engines.device)
    eng, dev = cfg.engines, torch.device(device)
    if device == "cuda":  # before the weights arrive: they count against the bound too
        bound_gpu_memory(dev, eng.gpu_memory_utilization)
    if model is None:
        path = resolve_model(cfg.model, run.models)
        model = load_causal_lm(path, dtype=cfg.model.dtype, device=device, attn=cfg.model.attn_implementation)
    lora_layers = None
    if cfg.actor.lora is not None:
        from molt_hpc.engine.lora import prepare

        lora_layers = prepare(model, cfg.actor.lora)
    vision = Vision(resolve_model(cfg.model, run.models)) if hasattr(model.config, "vision_config") else None
    eos = model.generation_config.eos_token_id if model.generation_config else model.config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if eng.exact:  # batch-invariant forwards: the trainer's model runs the same (models/exact.py)
        from molt_hpc.models.exact import make_exact

        make_exact(model)
    routing = RoutingRecorder(model) if cfg.actor.router_replay else None
    runner = model_runner(model, dev, eng, vision, graphs=routing is None)
    sched = Scheduler(
        runner,
        eos_ids=eos_ids,
        max_batch=eng.max_batch,
        max_model_len=eng.max_model_len,
        seed=cfg.run.seed * 1000 + index,
        routing=routing,
        prefill_interval=eng.prefill_interval,
    )
    vocab = model.config.get_text_config().vocab_size
    state = EngineState(sched, vocab, eng.max_model_len, str(cfg.model.path), index, place=place(dev), vision=vision)
    app = build_app(state, run.token(), open_health=cfg.router.kind == "vllm-router")
    sync = WeightSync(state, model, lora_only=cfg.actor.lora is not None, lora_layers=lora_layers)
    sync.add_routes(app)
    return app, sched, sync


async def serve(cfg: MoltConfig, run: RunDir, index: int, model=None) -> None:
    from aiohttp import web

    log = get_logger()
    app, sched, sync = build_engine(cfg, run, index, model)
    sched.start()
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    sock = socket.create_server((cfg.engines.host, 0))  # port 0: the kernel picks a free one
    await web.SockSite(runner, sock).start()
    port = sock.getsockname()[1]
    url = public_url(cfg.engines.host, port)

    sync.on_version = functools.partial(register_engine, run, index, url, kind="builtin")
    sync.on_version(sched.version)
    log.info("serving %s at %s (max_batch %d)", cfg.model.path, url, cfg.engines.max_batch)
    await serve_until_signal(runner, engine_file(run, index), log, functools.partial(abort_all, sched))
    sched.stop()


async def abort_all(sched) -> None:
    """A stopping engine ends every request it holds as `abort`, with the tokens it sampled: their clients
    continue them on other engines at once instead of waiting out the server's shutdown."""
    from concurrent.futures import Future

    done: Future = Future()
    await asyncio.wrap_future(sched.call(lambda: sched.pause("abort", done)))
    await asyncio.wrap_future(done)


def main(cfg: MoltConfig, run_dir: str | Path, index: int) -> int:
    """Run engine `index` of the run in `run_dir` until SIGTERM."""
    setup_logging(f"engine {index}", cfg.logging.level)
    asyncio.run(serve(cfg, RunDir(Path(run_dir)), index))
    return 0
