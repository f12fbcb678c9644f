"""Replay buffer hand-off: groups/s and latency for 8 × 4096-token groups on `fs` and `shm`.

Each backend is measured two ways, both with the producer in a separate (forked) process:
  - throughput: the producer puts N groups as fast as it can (backpressure at `capacity`), the
    consumer gets and acks them one by one; groups/s = N / (last ack − first put);
  - latency: the producer puts one group every `--gap` seconds so the spool is empty; hand-off
    latency = consumer's get returning − producer starting the put (encode, write, fsyncs,
    rename, the consumer's polling, read, decode).
The baseline, measured in the same run with the same harness and polling, moves the same encoded
bytes with plain file I/O: write to a temp name + fsync + rename, then read + unlink.

    .venv/bin/python bench/buffer.py [--groups 100] [--fs-dir /path/on/lustre]
"""

import argparse
import multiprocessing as mp
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from molt_hpc.buffer import ReplayBuffer
from molt_hpc.buffer.codec import decode_group, encode_group
from molt_hpc.config.infra import BufferConfig
from molt_hpc.trajectory import Group, Trajectory

SAMPLES, TOKENS, PROMPT = 8, 4096, 512


def make_group(gid: str) -> Group:
    samples = []
    for i in range(SAMPLES):
        n_act = TOKENS - PROMPT
        samples.append(
            Trajectory(
                tokens=[(i * 7919 + j * 31) % 151_000 for j in range(TOKENS)],
                prompt_len=PROMPT,
                action_ranges=[(PROMPT, TOKENS)],
                action_logprobs=[-0.001 * (j % 1000) for j in range(n_act)],
                versions=[3] * n_act,
                reward=float(i % 2),
                group_id=gid,
                rollout_id=f"{gid}-{i}",
            )
        )
    return Group(gid, f"p-{gid}", samples, {"epoch": 0, "index": 0})


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


class Raw:
    """The baseline: the same bytes through temp name + fsync + rename, then read + unlink."""

    def __init__(self, root: Path, data: bytes):
        self.dir, self.data = root, data

    def producer(self) -> Callable[[int, float], None]:
        def put(i: int, t_start: float) -> None:
            tmp = self.dir / f".tmp{i}"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.write(fd, self.data)
            os.fsync(fd)
            os.close(fd)
            os.rename(tmp, self.dir / f"{i:08d}-{t_start!r}")
            fsync_dir(self.dir)

        return put

    def consumer(self) -> Callable[[], float | None]:
        def take() -> float | None:
            """Read and remove the oldest file; its put start time, or None when there is none."""
            for name in sorted(n for n in os.listdir(self.dir) if not n.startswith(".")):
                (self.dir / name).read_bytes()
                os.unlink(self.dir / name)
                return float(name.split("-", 1)[1])
            return None

        return take


class Buffered:
    """The replay buffer: put, then get(1) + ack; the put's start time rides in the group's meta."""

    def __init__(self, root: Path, cfg: BufferConfig, template: Group):
        self.root, self.cfg, self.template = root, cfg, template

    def producer(self) -> Callable[[int, float], None]:
        buf, g = ReplayBuffer(self.root, self.cfg, producer_id="bench"), self.template

        def put(i: int, t_start: float) -> None:
            buf.put(Group(f"g{i}", g.prompt_id, g.samples, g.data_position, {"t_put": t_start}))

        return put

    def consumer(self) -> Callable[[], float | None]:
        buf = ReplayBuffer(self.root, self.cfg, consumer_id="bench")

        def take() -> float | None:
            got = buf.get(1, timeout=0)
            if not got:
                return None
            buf.ack([got[0].group_id])
            return got[0].meta["t_put"]

        return take


def produce(path: Raw | Buffered, n: int, gap: float) -> None:
    put = path.producer()
    for i in range(n):
        put(i, time.monotonic())
        if gap:
            time.sleep(gap)


def run(path: Raw | Buffered, n: int, gap: float, poll: float) -> tuple[float, list[float]]:
    """(groups/s, hand-off latencies) with the producer in a forked process and the same backoff polling."""
    take = path.consumer()
    proc = mp.get_context("fork").Process(target=produce, args=(path, n, gap))
    t0 = time.monotonic()
    proc.start()
    lat, delay = [], 0.001
    while len(lat) < n:
        t_put = take()
        if t_put is None:
            time.sleep(delay)
            delay = min(2 * delay, poll)
            continue
        lat.append(time.monotonic() - t_put)
        delay = 0.001
    elapsed = time.monotonic() - t0
    proc.join()
    assert proc.exitcode == 0, f"the producer failed with exit code {proc.exitcode}"
    return n / elapsed, lat


def codec_ms(group: Group, data: bytes, reps: int = 20) -> tuple[float, float]:
    """Median milliseconds to encode and to decode one group (Python lists <-> numpy dominate)."""
    enc, dec = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        encode_group(group)
        t1 = time.perf_counter()
        decode_group(data)
        dec.append(time.perf_counter() - t1)
        enc.append(t1 - t0)
    return statistics.median(enc) * 1000, statistics.median(dec) * 1000


def pct(values: list[float], q: float) -> float:
    """The q-th percentile in milliseconds."""
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--groups", type=int, default=100, help="groups in the throughput run")
    ap.add_argument("--latency-groups", type=int, default=50, help="groups in the paced latency run")
    ap.add_argument("--gap", type=float, default=0.02, help="seconds between puts in the latency run")
    ap.add_argument("--poll", type=float, default=0.01, help="buffer.poll_interval_s (and the baseline's)")
    ap.add_argument("--fs-dir", default=None, help="directory for the fs backend (default: a temp dir)")
    args = ap.parse_args()
    cfg = BufferConfig(capacity=32, poll_interval_s=args.poll)
    template = make_group("template")
    data = encode_group(template)
    enc, dec = codec_ms(template, data)
    print(f"group: {SAMPLES} × {TOKENS} tokens, {len(data) / 2**20:.2f} MiB encoded; poll ≤ {args.poll * 1000:.0f} ms")
    print(f"codec (in the buffer rows, not in raw): encode {enc:.1f} ms, decode {dec:.1f} ms per group")
    head = f"{'backend':<7} {'path':<9} {'groups/s':>9} {'x raw':>6} {'p50 ms':>7} {'p99 ms':>7} {'x raw':>6}"
    print(head + "\n" + "-" * len(head))
    for backend, base in (("fs", args.fs_dir), ("shm", "/dev/shm")):
        results = {}
        for name in ("raw", "buffer"):
            measured = []
            for n, gap in ((args.groups, 0.0), (args.latency_groups, args.gap)):
                root = Path(tempfile.mkdtemp(prefix=f"molt-bench-{name}-", dir=base))
                try:
                    path = Raw(root, data) if name == "raw" else Buffered(root, cfg, template)
                    measured.append(run(path, n, gap, args.poll))
                finally:
                    shutil.rmtree(root)
            (rate, _), (_, lat) = measured
            results[name] = (rate, pct(lat, 50), pct(lat, 99))
        base_rate, base_p50, _ = results["raw"]
        for name, (rate, p50, p99) in results.items():
            print(
                f"{backend:<7} {name:<9} {rate:>9.1f} {rate / base_rate:>6.2f} {p50:>7.2f} {p99:>7.2f} "
                f"{p50 / base_p50:>6.2f}"
            )


if __name__ == "__main__":
    main()
