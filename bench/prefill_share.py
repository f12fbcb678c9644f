"""Shared prefill: the samples of one prompt prefilled by one forward, on the CPU with the tiny model.

RL sends a group's `n_samples` requests with the same prompt at once; the engine's scheduler forwards each
distinct context once and copies its cache rows. Case: 8 groups x 8 samples, prompts of `--prompt` tokens,
8 new tokens each, through the scheduler in this process. Baseline, same run: 64 distinct prompts of the
same lengths (the same tokens to prefill and generate, nothing to share). Medians of `--repeats`
alternating rounds.

    .venv/bin/python bench/prefill_share.py [--prompt 256] [--threads 2] [--repeats 3]
"""

import argparse
import random
import statistics
import tempfile
import time
from concurrent.futures import Future
from pathlib import Path

import torch

from molt_hpc.config import load_config
from molt_hpc.engine.batch import ModelRunner, Row
from molt_hpc.engine.sampling import SamplingParams
from molt_hpc.engine.scheduler import Scheduler
from molt_hpc.models import build_tiny, load_causal_lm

GROUPS, SAMPLES, NEW = 8, 8, 8


def round_s(model, prompts: list[list[int]]) -> float:
    sched = Scheduler(ModelRunner(model, torch.device("cpu")), eos_ids=set(), max_batch=64, max_model_len=1024, seed=0)
    rows = [Row(list(p), SamplingParams(max_tokens=NEW, ignore_eos=True), Future()) for p in prompts]
    t0 = time.perf_counter()
    for row in rows:
        sched.submit(row)
    while sched.rows or sched.waiting:
        sched._step()
    assert all(len(r.tokens) == NEW for r in rows)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    vocab = 100  # inside every tiny vocabulary

    def prompt() -> list[int]:
        return [rng.randrange(4, vocab) for _ in range(args.prompt)]

    with tempfile.TemporaryDirectory(prefix="bench-share-") as tmp:
        model = load_causal_lm(build_tiny(Path(tmp) / "tiny", load_config(None).model.tiny))
    grouped = [p for p in (prompt() for _ in range(GROUPS)) for _ in range(SAMPLES)]
    distinct = [prompt() for _ in range(GROUPS * SAMPLES)]
    round_s(model, grouped[:8])  # warm-up
    shared, apart = [], []
    for _ in range(args.repeats):
        apart.append(round_s(model, distinct))
        shared.append(round_s(model, grouped))
    base = statistics.median(apart)
    print(f"{GROUPS} groups x {SAMPLES} samples, {args.prompt}-token prompts, {NEW} new tokens, tiny model, "
          f"{args.threads} threads, median of {args.repeats}")  # fmt: skip
    print("| case | seconds | vs baseline |")
    print("|---|---:|---:|")
    print(f"| 64 distinct prompts (baseline) | {base:.3f} | 1.00x |")
    print(f"| 8 prompts x 8 samples, shared prefill | {statistics.median(shared):.3f} | "
          f"{base / statistics.median(shared):.2f}x |")  # fmt: skip


if __name__ == "__main__":
    main()
