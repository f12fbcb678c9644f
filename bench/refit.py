"""Refit time and GB/s for a ≥ 100 MB model on CPU, over gloo and over shared memory, next to a raw gloo
broadcast of the same bytes.

The sender is this process (as trainer rank 0 would be); the receiver is a real engine process
holding the same architecture. A refit is the whole protocol: start (pause at a step boundary),
update (pack into flat buckets, broadcast or post them in the shared /dev/shm slots, copy them into
the parameters by name), finish (version bump, resume). `refit.backend = "auto"` takes gloo on a CPU
unless shared memory wins here.
The baseline, in the same run, is a separate plain process in a gloo group with this one: one
broadcast of all the bytes, and one per bucket of the same plan, each ended by a 1-element
all-reduce so the receiver has really received. Medians of `--repeats`.

    .venv/bin/python bench/refit.py [--repeats 5] [--buckets-mb 256 32]
"""

import argparse
import datetime
import json
import multiprocessing as mp
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from molt_hpc.config import load_config, to_toml
from molt_hpc.config.infra import RefitConfig
from molt_hpc.config.model import TinyModelConfig
from molt_hpc.models import build_tiny, load_causal_lm
from molt_hpc.refit import RefitSender
from molt_hpc.refit.buckets import TensorMeta, plan_buckets
from molt_hpc.rundir import create_run_dir

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine import start_engine as start_engine_process  # bench/engine.py

SHAPE = TinyModelConfig(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=2048)


def start_engine(run) -> tuple[subprocess.Popen, str]:
    return start_engine_process(run, threads=1, timeout_s=180.0)


def raw_group(port: int, rank: int) -> dist.ProcessGroupGloo:
    store = dist.TCPStore("127.0.0.1", port, None, rank == 0, datetime.timedelta(seconds=120), wait_for_workers=False)
    return dist.ProcessGroupGloo(dist.PrefixStore("raw/", store), rank, 2, datetime.timedelta(seconds=120)), store


def broadcast(pg, t: torch.Tensor) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    pg.broadcast([t], opts).wait()


def barrier(pg) -> None:
    pg.allreduce([torch.zeros(1)]).wait()


def raw_receiver(port: int, plans: list[list[int]], rounds: int) -> None:
    """The baseline's other end: receive every plan `rounds` times into preallocated buffers."""
    torch.set_num_threads(1)
    pg, _store = raw_group(port, 1)
    buffers = {n: torch.empty(n, dtype=torch.uint8) for plan in plans for n in plan}
    for _ in range(rounds):
        for plan in plans:
            for n in plan:
                broadcast(pg, buffers[n])
            barrier(pg)


def raw_send(pg, buffers: list[torch.Tensor]) -> float:
    t0 = time.perf_counter()
    for buf in buffers:
        broadcast(pg, buf)
    barrier(pg)
    return time.perf_counter() - t0


def parse_args() -> argparse.Namespace:
    """The command line: the repeats and the bucket sizes."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--buckets-mb", type=int, nargs="+", default=[256, 32])
    return ap.parse_args()


def free_port() -> int:
    """A port for the baseline's own store, from a store opened on port 0 and closed again."""
    port_store = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=5), wait_for_workers=False)
    port = port_store.port
    del port_store  # frees the port for the baseline's own store
    return port


def raw_baseline(pg, raw_plans: list[list[int]], repeats: int) -> dict[str, list[float]]:
    """Seconds of each raw gloo broadcast plan, `repeats` rounds after a warm-up, by row label."""
    times: dict[str, list[float]] = {}
    for r in range(repeats + 1):  # round 0 is the warm-up (first-touch of fresh buffers)
        for plan in raw_plans:
            label = "raw gloo broadcast, 1 buffer" if len(plan) == 1 else f"raw gloo broadcast, {len(plan)} buckets"
            dt = raw_send(pg, [torch.ones(n, dtype=torch.uint8) for n in plan])
            if r:
                times.setdefault(label, []).append(dt)
    return times


def refit_cases(senders, named, url: str, repeats: int) -> dict[str, list[float]]:
    """Seconds of each sender's refit into the engine at `url`, `repeats` pushes after a warm-up, by row label."""
    times: dict[str, list[float]] = {}
    version = 0
    for backend, mb, sender in senders:
        # One engine is in one group at a time: each case connects once, as a run does, then pushes;
        # its first push is the warm-up (fresh slots and buffers are first touched there).
        sender.connect([url])
        how = "gloo" if backend == "gloo" else "shared memory"
        for r in range(repeats + 1):
            version += 1
            st = sender.push(named, version)
            if r:
                times.setdefault(f"refit over {how}, bucket {mb} MiB ({st.buckets} buckets)", []).append(st.seconds)
        sender.close()
    return times


def print_table(times: dict[str, list[float]], total: int, tensors: int, repeats: int) -> None:
    """The header line and one row per case: median seconds, GB/s, the ratio to the raw 1-buffer broadcast."""
    base = statistics.median(times["raw gloo broadcast, 1 buffer"])
    print(f"model {total / 1e6:.1f} MB ({tensors} tensors, fp32), 1 engine process on this host", end="")
    print(f", median of {repeats}")
    print(f"| {'case':<52} | {'seconds':>8} | {'GB/s':>6} | {'vs raw 1 buffer':>15} |")
    print(f"|{'-' * 54}|{'-' * 10}|{'-' * 8}|{'-' * 17}|")
    for label, values in times.items():
        med = statistics.median(values)
        print(f"| {label:<52} | {med:8.3f} | {total / med / 1e9:6.2f} | {base / med:14.2f}x |")


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="bench-refit-") as tmp:
        model_dir = build_tiny(Path(tmp) / "model", SHAPE)
        cfg = load_config(None, [f"model.path={json.dumps(str(model_dir))}", "engines.threads=1"])
        run = create_run_dir(tmp, "run", to_toml(cfg))
        model = load_causal_lm(model_dir)
        named = list(model.named_parameters())
        metas = [TensorMeta.of(n, t) for n, t in named]
        total = sum(m.nbytes for m in metas)
        plans = [[b.nbytes for b in plan_buckets(metas, mb << 20)] for mb in args.buckets_mb]
        raw_plans = [[total]] + [plan for plan in plans if len(plan) > 1]

        port = free_port()
        child = mp.get_context("spawn").Process(target=raw_receiver, args=(port, raw_plans, args.repeats + 1))
        child.start()
        pg, _store = raw_group(port, 0)
        proc, url = start_engine(run)
        token = run.token()
        senders = [
            (backend, mb, RefitSender(run.path, RefitConfig(bucket_mb=mb, host="127.0.0.1", backend=backend), token))
            for backend in ("gloo", "ipc")
            for mb in args.buckets_mb
        ]
        try:
            times = raw_baseline(pg, raw_plans, args.repeats)
            times.update(refit_cases(senders, named, url, args.repeats))
        finally:
            proc.terminate()
            proc.wait()
            child.join(timeout=30)
    print_table(times, total, len(metas), args.repeats)


if __name__ == "__main__":
    main()
