"""Router overhead: requests/s and latency through each router kind vs straight to the engine, same run.

One engine, our router and vLLM's router (`router.kind = "vllm-router"`, when installed) run as
their own processes on loopback; the client sends `GET /v1/models` (a trivial engine route that
both routers forward like any `/v1/*` path), so what differs between the paths is the router's
hop: token check, engine choice, proxying. Each `--concurrency` level (requests kept in flight)
runs `--requests` requests per path and round after a warm-up; the paths alternate round by round.

    .venv/bin/python bench/router.py [--requests 2000] [--concurrency 1 16] [--rounds 3]
"""

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from molt_hpc.config import load_config, to_toml
from molt_hpc.models import build_tiny
from molt_hpc.rundir import create_run_dir

REPO = Path(__file__).resolve().parents[1]


def start(run, role: str, name: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "jobs" / "engine.py"), str(run.path), "--role", role, "--index", "0"],
        stdout=subprocess.DEVNULL,
        stderr=open(run.logs / f"{name}.log", "wb"),  # noqa: SIM115 - the child owns it
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    path = run.rendezvous / f"{name}.json"
    for _ in range(1200):
        if path.exists() and json.loads(path.read_text())["pid"] == proc.pid:
            return proc, json.loads(path.read_text())["url"]
        if proc.poll() is not None:
            raise SystemExit(f"{name} died:\n{(run.logs / f'{name}.log').read_text()}")
        time.sleep(0.1)
    raise SystemExit(f"{name} did not start")


async def load(url: str, token: str, n: int, concurrency: int) -> tuple[float, list[float]]:
    """(seconds for n requests, per-request latencies) with `concurrency` in flight."""
    headers = {"Authorization": f"Bearer {token}", "X-Session-ID": "bench"}
    latencies: list[float] = []
    todo = iter(range(n))
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:

        async def worker():
            for _ in todo:
                t0 = time.perf_counter()
                async with s.get(url + "/v1/models", headers=headers) as r:
                    await r.read()
                    assert r.status == 200, r.status
                latencies.append(time.perf_counter() - t0)

        t0 = time.perf_counter()
        await asyncio.gather(*[worker() for _ in range(concurrency)])
        return time.perf_counter() - t0, latencies


def pct(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))]


def wait_for_engine(router_url: str, token: str) -> None:
    async def go():
        async with aiohttp.ClientSession() as s:
            for _ in range(600):
                async with s.get(router_url + "/health", headers={"Authorization": f"Bearer {token}"}) as r:
                    if (await r.json())["engines"] >= 1:
                        return
                await asyncio.sleep(0.1)
        raise SystemExit("the router never saw the engine")

    asyncio.run(go())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-router-") as tmp:
        model_dir = build_tiny(Path(tmp) / "tiny", load_config(None).model.tiny)
        base = [f"model.path={json.dumps(str(model_dir))}", "engines.threads=1"]
        vllm_router = shutil.which("vllm-router", path=str(Path(sys.executable).parent)) is not None
        # The engine runs as with vLLM's router (it then also answers a tokenless /health); our
        # router serves a second run directory that shares the first one's token and rendezvous.
        kind = "vllm-router" if vllm_router else "builtin"
        run = create_run_dir(tmp, "run", to_toml(load_config(None, [*base, f"router.kind={kind}"])))
        token = run.token()
        procs = []
        try:
            engine, engine_url = start(run, "engine", "engine-0")
            procs.append(engine)
            ours = create_run_dir(tmp, "ours", to_toml(load_config(None, base)))
            shutil.copytree(run.rendezvous, ours.rendezvous, dirs_exist_ok=True)
            router, router_url = start(ours, "router", "router")
            procs.append(router)
            wait_for_engine(router_url, token)
            paths = {"direct": engine_url, "through router": router_url}
            if vllm_router:
                vrouter, paths["through vllm-router"] = start(run, "router", "router")
                procs.append(vrouter)
            for url in paths.values():  # warm-up
                asyncio.run(load(url, token, 200, 4))
            rows = [measure(paths, token, c, args) for c in args.concurrency]
        finally:
            for p in procs:
                p.terminate()
                p.wait()
    print(
        f"GET /v1/models, {args.requests} requests × {args.rounds} rounds per row, 1 engine, loopback, 2 shared cores"
    )
    print("| path                | in flight |   req/s | vs direct |  p50 ms |  p99 ms | added p50 | added p99 |")
    print("|---------------------|-----------|---------|-----------|---------|---------|-----------|-----------|")
    for line in rows:
        print(line)


def measure(paths: dict[str, str], token: str, concurrency: int, args) -> str:
    """Every path at one concurrency, rounds alternating; one table line per path."""
    rps: dict[str, list[float]] = {name: [] for name in paths}
    lat: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(args.rounds):
        for name, url in paths.items():
            secs, latencies = asyncio.run(load(url, token, args.requests, concurrency))
            rps[name].append(args.requests / secs)
            lat[name].extend(latencies)
    base = statistics.median(rps["direct"])
    d50, d99 = pct(lat["direct"], 0.5), pct(lat["direct"], 0.99)
    lines = []
    for name in paths:
        r = statistics.median(rps[name])
        p50, p99 = pct(lat[name], 0.5), pct(lat[name], 0.99)
        lines.append(
            f"| {name:<19} | {concurrency:>9} | {r:7.0f} | {r / base:8.2f}x | {p50 * 1e3:7.2f} | {p99 * 1e3:7.2f} | "
            f"{(p50 - d50) * 1e3:+7.2f}ms | {(p99 - d99) * 1e3:+7.2f}ms |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
