"""The vLLM engine process (`engines.kind = "vllm"`): check vLLM, run `vllm serve` on loopback, serve its front.

One process per engine, started by the pool like the builtin engine (`CUDA_VISIBLE_DEVICES` already
narrowed to its GPUs). It checks that vLLM is installed and matches torch from package metadata
(importing vLLM is heavy and needs CUDA; this process never imports torch), starts
`python -m vllm.entrypoints.openai.api_server` as a child listening on 127.0.0.1 (its dev routes are
not token-guarded), waits for its `/health`, then serves the front (`front.py`) on
`engines.host` and registers `rendezvous/engine-<index>.json`.
SIGTERM/SIGINT: unregister, stop vLLM, exit 0. vLLM dying: unregister, exit 1 (the pool restarts us).
An engine over several nodes (`span.py`) runs this process on each: the head as above, the
others a headless `vllm serve` that joins the head and serves nothing.
"""

import asyncio
import contextlib
import ctypes
import functools
import importlib.metadata
import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

from molt_hpc.config import MoltConfig
from molt_hpc.config.vllm_lora import configured_max_rank, vllm_max_lora_rank
from molt_hpc.engine.main import engine_file, public_url, register_engine
from molt_hpc.engine.vllm.span import (
    Span,
    head_address,
    head_file,
    publish_head,
    read_head,
    span_flags,
    span_of,
    wait_head,
)
from molt_hpc.log import get_logger, log_tail, setup_logging
from molt_hpc.net import free_port, keep_stopping
from molt_hpc.rundir import RunDir
from molt_hpc.vision.spec import is_vision_model

TESTED_VLLM = "0.26.0"
FIX = "pip install 'molt-hpc[gpu]' (vllm==0.26.0, which pins torch 2.11), or set engines.kind = 'builtin'"
STOP_GRACE_S = 20.0
WORKER_EXTENSION = "molt_hpc.engine.vllm.ipc.MoltWorkerExtension"
PACKAGE_ROOT = str(Path(__file__).resolve().parents[3])
"""Where `molt_hpc` is imported from here: vLLM's workers import the extension from there too."""
PR_SET_PDEATHSIG = 1
ROUTED_EXPERTS_FLAG = "--enable-return-routed-experts"


def check_vllm_torch(vllm_version: str, required_torch: str | None, torch_version: str) -> None:
    """Refuse a torch other than the one vLLM pins (`torch==X` in its requirements); the local part
    of torch's version (`+cu130`) does not count."""
    have = torch_version.split("+", 1)[0]
    if required_torch is not None and have != required_torch:
        raise ValueError(
            f"vLLM {vllm_version} requires torch=={required_torch} but this environment has torch {torch_version}: "
            f"{FIX}"
        )


def required_torch(requirements: list[str] | None) -> str | None:
    """The version X of the unconditional `torch==X` requirement, if vLLM pins one."""
    for req in requirements or []:
        match = re.fullmatch(r"torch\s*==\s*([^\s;,]+)\s*(;.*)?", req.strip())
        if match and "extra" not in (match.group(2) or ""):
            return match.group(1)
    return None


def check_vllm() -> str:
    """vLLM's version, after checking it is installed and matches this torch; else a `ValueError` naming the fix."""
    try:
        version = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        raise ValueError(f"engines.kind = 'vllm' but vLLM is not installed in {sys.prefix}: {FIX}") from None
    if importlib.util.find_spec("vllm") is None:
        raise ValueError(f"vLLM {version} has package metadata but cannot be imported from {sys.prefix}: {FIX}")
    try:
        # The installed wheel's version is torch.__version__ (with its +cu… part) without importing torch here.
        torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        raise ValueError(f"vLLM {version} is installed but torch is not: {FIX}") from None
    check_vllm_torch(version, required_torch(importlib.metadata.requires("vllm")), torch_version)
    return version


def check_all2all(eng) -> None:
    """A DeepEP all-to-all backend needs `deep_ep` importable next to vLLM; else a `ValueError` naming the fix."""
    if eng.expert_parallel and eng.all2all_backend.startswith("deepep") and importlib.util.find_spec("deep_ep") is None:
        raise ValueError(
            f"engines.all2all_backend = {eng.all2all_backend!r} but the deep_ep package is not installed in "
            f"{sys.prefix}: build DeepEP for vLLM's torch and CUDA there (no PyPI wheel), or use "
            "engines.all2all_backend = 'allgather_reducescatter'"
        )


def vllm_command(cfg: MoltConfig, model_dir: str | Path, port: int, index: int, span: Span | None = None) -> list[str]:
    """`vllm serve` for engine `index` on 127.0.0.1:`port`, or for this node's part `span` of a multi-node
    engine (a headless part serves no HTTP: `port` is unused). The token goes in the environment
    (`vllm_env`), not here: a command line is readable by every user of the node."""
    eng, model = cfg.engines, cfg.model
    if span is not None and not span.head:  # the API server module has no headless mode; the CLI's serve has
        cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", "--model", str(model_dir)]
    else:
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)]
        cmd += ["--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--served-model-name", model.path, "--dtype", model.dtype]
    cmd += ["--tensor-parallel-size", str(eng.tensor_parallel), "--max-model-len", str(eng.max_model_len)]
    cmd += ["--gpu-memory-utilization", str(eng.gpu_memory_utilization), "--max-num-seqs", str(eng.max_batch)]
    cmd += ["--seed", str(cfg.run.seed * 1000 + index)]
    if span is not None:
        cmd += span_flags(span)
    elif eng.data_parallel > 1:
        cmd += ["--data-parallel-size", str(eng.data_parallel)]
    if eng.expert_parallel:
        cmd += ["--enable-expert-parallel", "--all2all-backend", eng.all2all_backend]
    if eng.enforce_eager:
        cmd.append("--enforce-eager")
    cmd.append("--enable-prefix-caching" if eng.prefix_caching else "--no-enable-prefix-caching")
    # Token ids in and out; the request's sampling parameters, not the model's generation_config defaults;
    # refit over NCCL through the dev routes.
    cmd += ["--logprobs-mode", eng.logprobs_mode, "--generation-config", "vllm"]
    if is_vision_model(model_dir):
        # Images go through render (the chat template needs the tokenizer); no processor cache, whose
        # entries would outlive a refit; as many images per request as a trajectory may carry.
        cmd += ["--mm-processor-cache-gb", "0", "--limit-mm-per-prompt", json.dumps({"image": cfg.rollout.max_images})]
    else:
        cmd.append("--skip-tokenizer-init")
    cmd += ["--weight-transfer-config", json.dumps({"backend": "nccl"})]
    # The shared-memory refit to an engine on the trainer's GPU, reached through /collective_rpc.
    cmd += ["--worker-extension-cls", WORKER_EXTENSION]
    cmd += lora_flags(cfg)
    if cfg.actor.router_replay and ROUTED_EXPERTS_FLAG not in eng.extra_args:
        cmd.append(ROUTED_EXPERTS_FLAG)  # every answer carries the experts of each token (router replay)
    # an access-log line per request costs the API server's event loop on every one of a step's thousands
    cmd.append("--disable-uvicorn-access-log")
    if eng.max_num_batched_tokens is not None:
        cmd += ["--max-num-batched-tokens", str(eng.max_num_batched_tokens)]
    return cmd + list(eng.extra_args)


def lora_flags(cfg: MoltConfig) -> list[str]:
    """A LoRA run's engine serves adapters: the rank it must hold (`config/vllm_lora.py`), and two adapters
    at once (the current version's and the one it replaced, until that one's requests finish)."""
    if cfg.actor.lora is None:
        return []
    rank = [] if configured_max_rank(cfg.engines.extra_args) else ["--max-lora-rank", str(vllm_max_lora_rank(cfg))]
    return ["--enable-lora", *rank, "--max-loras", "2", "--max-cpu-loras", "2"]


def vllm_env(token: str, lora: bool = False) -> dict[str, str]:
    """vLLM's environment: ours, plus the API key, the dev routes (pause, weight transfer), no NVLink
    multicast; for a LoRA run, the routes that load and unload adapters (behind our front, as the rest)."""
    env = {**os.environ, "VLLM_API_KEY": token, "VLLM_SERVER_DEV_MODE": "1", "NCCL_NVLS_ENABLE": "0"}
    if lora:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # its sampler needs flashinfer, not a vLLM dependency
    # Last: what is already on the path (vLLM installed with --target, say) keeps precedence.
    path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != PACKAGE_ROOT]
    env["PYTHONPATH"] = os.pathsep.join([*path, PACKAGE_ROOT])
    return env


def _die_with_parent() -> None:
    # vLLM lives in its own session (a stop reaches its workers); if we are killed outright, it gets SIGTERM.
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def start_vllm(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        return subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
            start_new_session=True, preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )  # fmt: skip


def stop_vllm(proc: subprocess.Popen, grace_s: float = STOP_GRACE_S) -> int:
    """SIGTERM vLLM's process group, SIGKILL it after `grace_s`; its exit code."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, None)):
        with contextlib.suppress(ProcessLookupError):  # the group is already gone
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):  # still running: escalate
            return proc.wait(timeout=wait)
    raise AssertionError("unreachable: wait() without a timeout returns")


def vllm_log(run: RunDir, index: int, rank: int = 0) -> Path:
    return run.logs / (f"vllm-{index}.log" if rank == 0 else f"vllm-{index}-node{rank}.log")


async def wait_healthy(proc: subprocess.Popen, url: str, log: Path, timeout_s: float, stop: asyncio.Event) -> bool:
    """Poll vLLM's `/health` until 200 (True) or a stop is asked (False); raise if it exits or times out."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        while not stop.is_set():
            if proc.poll() is not None:
                raise RuntimeError(
                    f"vLLM exited with {proc.returncode} before it was ready; end of {log}:\n{log_tail(log)}"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"vLLM did not answer /health within engines.startup_timeout_s = {timeout_s}; end of {log}:\n"
                    f"{log_tail(log)}"
                )
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):  # not listening yet: poll again
                async with session.get(url + "/health") as resp:
                    if resp.status == 200:
                        return True
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)
    return False


async def worker_place(front) -> dict:
    """Where vLLM's workers run (our extension's `molt_place`, one answer per worker); {} when it cannot
    say, and then the trainer refits this engine over NCCL."""
    from molt_hpc.engine.vllm.front import call_upstream, upstream_message

    status, raw, _ = await call_upstream(front, "POST", "/collective_rpc", "application/json",
                                         data=json.dumps({"method": "molt_place", "timeout": 60}).encode())  # fmt: skip
    try:
        places = json.loads(raw)["results"] if status == 200 else None
        uuids = [u for p in places for u in p["device_uuids"]]
        return {"host_id": places[0]["host_id"], "shm_id": places[0].get("shm_id"), "device_uuids": uuids}
    except (ValueError, KeyError, IndexError, TypeError):
        get_logger().warning("vLLM's workers did not say where they run (HTTP %s: %s)", status, upstream_message(raw))
        return {}


async def serve_front(
    cfg: MoltConfig, run: RunDir, index: int, proc: subprocess.Popen, upstream: str, stop: asyncio.Event
) -> int:
    """Serve the front and stay registered until a stop (0) or vLLM's death (1)."""
    from aiohttp import web

    from molt_hpc.engine.vllm.adapters import AdapterSlots
    from molt_hpc.engine.vllm.front import Front, build_front

    log = get_logger()
    open_health = cfg.router.kind == "vllm-router"
    front = Front(upstream, run.token(), index, open_health=open_health, routed=cfg.actor.router_replay)
    if cfg.actor.lora is not None:
        front.adapters = AdapterSlots()
    runner = web.AppRunner(build_front(front), handler_cancellation=True, access_log=None)
    await runner.setup()
    front.place = await worker_place(front)
    sock = socket.create_server((cfg.engines.host, 0))  # port 0: the kernel picks a free one
    await web.SockSite(runner, sock).start()
    url = public_url(cfg.engines.host, sock.getsockname()[1])

    front.on_version = functools.partial(register_engine, run, index, url, kind="vllm")
    front.on_version(front.version)
    log.info("serving %s at %s (vLLM at %s)", cfg.model.path, url, upstream)
    try:
        while not stop.is_set():
            if proc.poll() is not None:
                log.error(
                    "vLLM exited with %s while serving; end of its log:\n%s",
                    proc.returncode,
                    log_tail(vllm_log(run, index)),
                )
                return 1
            with contextlib.suppress(TimeoutError):  # a second passed: look at vLLM again
                await asyncio.wait_for(stop.wait(), 1.0)
        log.info("stopping")
        return 0
    finally:
        with contextlib.suppress(FileNotFoundError):  # already removed: nothing to unregister
            os.unlink(engine_file(run, index))
        await runner.cleanup()


def _stop_event() -> asyncio.Event:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_stop() -> None:
        keep_stopping()
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_stop)
    return stop


def _checked_model(cfg: MoltConfig, run: RunDir) -> tuple[str, Path]:
    """(vLLM's version, the model directory) once vLLM is checked; a `ValueError` naming the fix if not."""
    from molt_hpc.models import resolve_model

    version = check_vllm()  # before anything slow: a missing vLLM fails in seconds
    check_all2all(cfg.engines)
    if version != TESTED_VLLM:
        get_logger().warning("vLLM %s: the engine protocol and the refit were verified with vLLM %s", version,
                             TESTED_VLLM)  # fmt: skip
    return version, resolve_model(cfg.model, run.models)


async def serve(cfg: MoltConfig, run: RunDir, index: int) -> int:
    """Check vLLM, start it, wait for it, serve its front; the process's exit code. The head of a
    multi-node engine first publishes where its other nodes join it."""
    log = get_logger()
    version, model_dir = _checked_model(cfg, run)
    stop = _stop_event()
    port = free_port("127.0.0.1")
    upstream = f"http://127.0.0.1:{port}"
    span = None
    if cfg.engines.nodes_per_engine > 1:
        span = span_of(cfg.engines, 0, head_address(cfg.engines.host), free_port(""))
        publish_head(run, index, span.address, span.rpc_port)
    env = vllm_env(run.token(), lora=bool(cfg.actor.lora))
    proc = start_vllm(vllm_command(cfg, model_dir, port, index, span), env, vllm_log(run, index))
    log.info("started vLLM %s (pid %d) on %s, log %s", version, proc.pid, upstream, vllm_log(run, index))
    try:
        if not await wait_healthy(proc, upstream, vllm_log(run, index), cfg.engines.startup_timeout_s, stop):
            return 0
        log.info("vLLM is ready")
        return await serve_front(cfg, run, index, proc, upstream, stop)
    finally:
        if span is not None:
            with contextlib.suppress(FileNotFoundError):  # already removed
                os.unlink(head_file(run, index))
        log.info("vLLM stopped (exit %s)", stop_vllm(proc))


async def serve_headless(cfg: MoltConfig, run: RunDir, index: int, rank: int) -> int:
    """Node `rank` of engine `index`: join its head with a headless vLLM until a stop (0), or until vLLM
    dies or the head goes or is replaced (1: the pool restarts us and we join the new head)."""
    log = get_logger()
    version, model_dir = _checked_model(cfg, run)
    stop = _stop_event()
    head = await wait_head(run, index, cfg.engines.startup_timeout_s, stop)
    if head is None:
        return 0
    span = span_of(cfg.engines, rank, head["address"], int(head["rpc_port"]))
    log_path = vllm_log(run, index, rank)
    env = vllm_env(run.token(), lora=bool(cfg.actor.lora))
    proc = start_vllm(vllm_command(cfg, model_dir, 0, index, span), env, log_path)
    log.info("started headless vLLM %s (pid %d), data-parallel ranks %d-%d of engine %d (head %s:%d), log %s",
             version, proc.pid, span.start_rank, span.start_rank + span.local - 1, index, span.address,
             span.rpc_port, log_path)  # fmt: skip
    try:
        while not stop.is_set():
            if proc.poll() is not None:
                log.error("headless vLLM exited with %s; end of its log:\n%s", proc.returncode, log_tail(log_path))
                return 1
            if (read_head(run, index) or {}).get("nonce") != head["nonce"]:
                log.warning("engine %d's head is gone or was replaced: leaving, to join the next one", index)
                return 1
            with contextlib.suppress(TimeoutError):  # a second passed: look again
                await asyncio.wait_for(stop.wait(), 1.0)
        return 0
    finally:
        log.info("vLLM stopped (exit %s)", stop_vllm(proc))


def main(cfg: MoltConfig, run_dir: str | Path, index: int, rank: int = 0) -> int:
    """Run vLLM engine `index` of the run in `run_dir` (node `rank` of it) until SIGTERM (0) or vLLM's death (1)."""
    if rank == 0:
        setup_logging(f"engine {index}", cfg.logging.level)
        return asyncio.run(serve(cfg, RunDir(Path(run_dir)), index))
    setup_logging(f"engine {index} node {rank}", cfg.logging.level)
    return asyncio.run(serve_headless(cfg, RunDir(Path(run_dir)), index, rank))
