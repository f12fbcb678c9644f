"""Extra engine pools on a live pool, same run: join time, rollout throughput, and what a migration costs.

One builtin engine and the router run as their own processes on the tiny model (CPU, one thread
each). Measured, each against its baseline in the same run:

- join: seconds from `molt-hpc engines add RUN --local` to the first request the new engine answers
  (its registration, the router's health check; no trainer here, so no refit wait);
- throughput: generated tokens/s of `--streams` concurrent sessions (`--tokens` each, streamed through
  the link with continuation) for `--seconds` before the pool, while it serves, and after its removal;
- migration: a `--tokens` request that finishes on its engine vs the same request (same seed) whose
  engine is stopped (SIGTERM) after half of it (it continues on the other engine from the kept tokens). A
  vLLM engine finishes the requests it holds before it stops, so with `engines.kind = "vllm"` nothing migrates
  here (`requests_migrated` says so); its SIGKILL case is `tests/test_vllm_front_stream.py`.

    .venv/bin/python bench/elastic.py [--streams 8] [--tokens 64] [--seconds 20] [--rounds 5]

`--config` runs the engines of another config (its model, engine kind and device) instead of the tiny CPU
model, with `--set` overrides; on one GPU the engines share it, so give each a share, e.g.

    python bench/elastic.py --config configs/smollm2_gym_gpu.toml --set engines.kind='"vllm"' \
        --set engines.gpu_memory_utilization=0.3 --rounds 1
"""

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from molt_hpc.config import load_config, to_toml
from molt_hpc.models import build_tiny
from molt_hpc.rollout.engines import EngineLink
from molt_hpc.router.ring import HashRing
from molt_hpc.rundir import RunDir, create_run_dir

REPO = Path(__file__).resolve().parents[1]
NO_STOP = {"ignore_eos": True, "stop_token_ids": []}


def start(run: RunDir, role: str, index: int, name: str) -> subprocess.Popen:
    cmd = [sys.executable, str(REPO / "jobs" / "engine.py"), str(run.path), "--role", role, "--index", str(index)]
    log = open(run.logs / f"{name}.log", "wb")  # noqa: SIM115 - the child owns it
    proc = subprocess.Popen(cmd, stdout=log, stderr=log, env={**os.environ, "OMP_NUM_THREADS": "1"})
    path = run.rendezvous / f"{name}.json"
    while not (path.exists() and json.loads(path.read_text())["pid"] == proc.pid):
        if proc.poll() is not None:
            raise SystemExit(f"{name} died:\n{(run.logs / f'{name}.log').read_text()}")
        time.sleep(0.1)
    return proc


def molt(*args: str) -> str:
    out = subprocess.run([sys.executable, "-c", "from molt_hpc.cli import main; main()", *args],
                         capture_output=True, text=True, cwd=REPO)  # fmt: skip
    if out.returncode:
        raise SystemExit(out.stderr)
    return out.stdout


async def metrics(link: EngineLink) -> list[dict]:
    async with link.session.get(link.router_url + "/metrics", headers={"Authorization": f"Bearer {link.token}"}) as r:
        return (await r.json())["engines"]


async def throughput(link: EngineLink, streams: int, tokens: int, seconds: float) -> float:
    done, stop = [0], time.monotonic() + seconds

    async def stream(i: int) -> None:
        n = 0
        while time.monotonic() < stop:
            params = {"max_tokens": tokens, "seed": n, **NO_STOP}
            out = await link.generate([1, 2, 3, 4], params, f"s{i}-{n}")
            done[0] += len(out.token_ids)
            n += 1

    t0 = time.monotonic()
    await asyncio.gather(*(stream(i) for i in range(streams)))
    return done[0] / (time.monotonic() - t0)


def session_on(node: str, nodes: set[str], virtual_nodes: int, salt: str) -> str:
    ring = HashRing(virtual_nodes)
    ring.set_nodes(nodes)
    return next(s for s in (f"{salt}-{i}" for i in range(100_000)) if ring.lookup(s) == node)


async def one_request(link: EngineLink, session: str, tokens: int, cut=None) -> float:
    """Seconds for one request; with `cut`, `cut()` runs once half of it has streamed."""
    t0 = time.perf_counter()
    task = asyncio.create_task(link.generate([1, 2, 3, 4], {"max_tokens": tokens, "seed": 7, **NO_STOP}, session))
    if cut is not None:
        while len(getattr(link.streaming.get(session), "token_ids", [])) < tokens // 2:
            await asyncio.sleep(0.001)
        cut()
    out = await task
    assert len(out.token_ids) == tokens
    return time.perf_counter() - t0


async def migration(link: EngineLink, run: RunDir, cfg, tokens: int, rounds: int) -> tuple[list[float], list[float]]:
    same, moved = [], []
    for r in range(rounds):
        extra = start(run, "engine", 500 + r, f"engine-{500 + r}")
        while not any(e["index"] == 500 + r and e["healthy"] for e in await metrics(link)):
            await asyncio.sleep(0.05)
        nodes = {f"engine-{e['index']}" for e in await metrics(link) if e["healthy"]}
        target = f"engine-{500 + r}"
        # untimed first: a fresh GPU engine captures its CUDA graphs on its first requests (~1 s on an H200)
        await one_request(link, session_on(target, nodes, cfg.router.virtual_nodes, f"w{r}"), tokens)
        same.append(await one_request(link, session_on(target, nodes, cfg.router.virtual_nodes, f"a{r}"), tokens))
        session = session_on(target, nodes, cfg.router.virtual_nodes, f"b{r}")
        moved.append(await one_request(link, session, tokens, cut=lambda p=extra: p.send_signal(signal.SIGTERM)))
        extra.wait()
    return same, moved


async def main_async(args, run: RunDir, cfg) -> dict:
    router = json.loads((run.rendezvous / "router.json").read_text())["url"]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        link = EngineLink(http, router, run.token(), run, 120)
        before = await throughput(link, args.streams, args.tokens, args.seconds)
        t0 = time.perf_counter()
        await asyncio.to_thread(molt, "engines", "add", str(run.path), "--local", "--count", "1")
        nodes = set()
        while "engine-1000" not in nodes:
            await asyncio.sleep(0.02)
            nodes = {f"engine-{e['index']}" for e in await metrics(link) if e["healthy"]}
        first = session_on("engine-1000", nodes, cfg.router.virtual_nodes, "join")
        await link.generate([1, 2, 3], {"max_tokens": 1}, first)
        join_s = time.perf_counter() - t0
        during = await throughput(link, args.streams, args.tokens, args.seconds)
        await asyncio.to_thread(molt, "engines", "remove", str(run.path), "pool-1", "--drain-s", "30")
        after = await throughput(link, args.streams, args.tokens, args.seconds)
        same, moved = await migration(link, run, cfg, args.tokens * 2, args.rounds)
        counts = link.take_counts()
    requests = {"same_engine": statistics.median(same), "migrated_once": statistics.median(moved)} if same else {}
    return {"engine_kind": cfg.engines.kind, "model": cfg.model.path, "join_s": join_s,
            "tokens_per_s": {"before": before, "while": during, "after": after}, "request_s": requests,
            "rounds": args.rounds, "request_tokens": args.tokens * 2, **counts}  # fmt: skip


def bench_config(args, root: Path):
    """The run's config: `--config` with `--set`, or the tiny CPU model with one thread per engine."""
    fast_health = ["router.health_interval_s=0.5"]
    if args.config is not None:
        return load_config(args.config, [*fast_health, *args.overrides])
    model = build_tiny(root / "model", load_config(None).model.tiny)
    return load_config(None, [f"model.path={json.dumps(str(model))}", "engines.threads=1", *fast_health,
                              *args.overrides])  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--rounds", type=int, default=5, help="migration rounds (0: none)")
    p.add_argument("--config", type=Path, help="engines of this config instead of the tiny CPU model")
    p.add_argument("--set", action="append", default=[], dest="overrides", metavar="KEY=VALUE")
    p.add_argument("--keep", type=Path, help="run in this directory and keep its logs (default: a temporary one)")
    args = p.parse_args()
    print(json.dumps(vars(args), default=str), flush=True)
    root = args.keep or Path(tempfile.mkdtemp(prefix="molt-elastic-"))
    root.mkdir(parents=True, exist_ok=True)
    procs = []
    try:
        cfg = bench_config(args, root)
        run = create_run_dir(root, "run", to_toml(cfg))
        procs = [start(run, "engine", 0, "engine-0"), start(run, "router", 0, "router")]
        print(json.dumps(asyncio.run(main_async(args, run, cfg)), indent=1))
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait()
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
