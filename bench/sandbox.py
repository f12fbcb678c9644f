"""Sandbox executions per second and their latency on this machine, against a plain `python3 -c` baseline.

Rows, each round in a rotated order, `--n` executions of a small program (`print(sum(range(1000)))`):
- plain subprocess: `python3 -c CODE` with asyncio, `--concurrency` at once: no isolation, no HTTP (the floor);
- sandbox, bwrap: the sandbox server process at its default pool size (`sandbox.workers`), through the
  client over loopback HTTP, `--concurrency` requests at once;
- sandbox, rlimit: the same with `sandbox.isolation = "rlimit"` (what bwrap itself costs);
- sandbox, bwrap, queued: `--queued` requests at once, so most wait in the server's queue (latency
  includes the wait; executions/s is the pool's saturated rate).
Latency is the client's: from sending the request to having the result.

    .venv/bin/python bench/sandbox.py [--n 200] [--rounds 3] [--concurrency 2] [--queued 16]
"""

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from molt_hpc.config.sandbox import SandboxConfig  # noqa: E402
from molt_hpc.sandbox.client import SandboxClient  # noqa: E402
from tests.sandbox_support import sandbox_run, start_sandbox  # noqa: E402

CODE = "print(sum(range(1000)))"


async def timed(n: int, concurrency: int, one) -> tuple[float, list[float]]:
    """(executions/s, latencies) of `n` calls of `one()`, `concurrency` at a time."""
    gate = asyncio.Semaphore(concurrency)
    latencies: list[float] = []

    async def call() -> None:
        async with gate:
            start = time.perf_counter()
            out = await one()
            latencies.append(time.perf_counter() - start)
            assert out == "499500\n", out

    start = time.perf_counter()
    await asyncio.gather(*(call() for _ in range(n)))
    return n / (time.perf_counter() - start), latencies


async def plain(python: str) -> str:
    proc = await asyncio.create_subprocess_exec(python, "-c", CODE, stdout=asyncio.subprocess.PIPE)
    out, _ = await proc.communicate()
    return out.decode()


def through(client: SandboxClient):
    async def one() -> str:
        result = await client.run(CODE)
        return result.stdout

    return one


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


async def bench(args, runs: dict) -> list[dict]:
    clients = {name: SandboxClient(run.path) for name, run in runs.items()}
    python = SandboxConfig().python
    rows = {
        "plain subprocess": (lambda: plain(python), args.concurrency),
        "sandbox, bwrap": (through(clients["bwrap"]), args.concurrency),
        "sandbox, rlimit": (through(clients["rlimit"]), args.concurrency),
        "sandbox, bwrap, queued": (through(clients["bwrap"]), args.queued),
    }
    await timed(8, 2, through(clients["bwrap"]))  # warm: connections, page cache
    rounds = []
    names = list(rows)
    for r in range(args.rounds):
        out = {}
        for name in names[r % len(names) :] + names[: r % len(names)]:
            one, conc = rows[name]
            out[name] = await timed(args.n, conc, one)
        rounds.append(out)
    for client in clients.values():
        await client.close()
    return rounds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=200, help="executions per row and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=2, help="requests at once (the default pool size)")
    ap.add_argument("--queued", type=int, default=16, help="requests at once in the queued row")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        runs = {
            "bwrap": sandbox_run(Path(tmp) / "b", "sandbox.isolation='bwrap'"),
            "rlimit": sandbox_run(Path(tmp) / "r", "sandbox.isolation='rlimit'"),
        }
        procs = [start_sandbox(run) for run in runs.values()]
        try:
            rounds = asyncio.run(bench(args, runs))
        finally:
            for p in procs:
                p.stop()
    cores = len(os.sched_getaffinity(0))
    workers = SandboxConfig().workers
    print(f"{args.n} executions of `{CODE}` per row and round; median of {args.rounds} rounds in a rotated order;")
    print(f"{cores} cores, sandbox pool at its default size ({workers} workers), client over loopback HTTP")
    print("| row                     | at once | executions/s | p50 ms | p99 ms | vs plain |")
    print("|-------------------------|---------|--------------|--------|--------|----------|")
    base = statistics.median(r["plain subprocess"][0] for r in rounds)
    for name in rounds[0]:
        rate = statistics.median(r[name][0] for r in rounds)
        p50 = statistics.median(pct(r[name][1], 50) for r in rounds) * 1000
        p99 = statistics.median(pct(r[name][1], 99) for r in rounds) * 1000
        conc = args.queued if name.endswith("queued") else args.concurrency
        print(f"| {name:<23} | {conc:7d} | {rate:12.1f} | {p50:6.1f} | {p99:6.1f} | {rate / base:7.2f}x |")


if __name__ == "__main__":
    main()
