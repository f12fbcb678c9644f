"""Engine throughput: 32 concurrent requests × 64 new tokens on the tiny model, next to HF `generate`.

The engine runs as its own process (real HTTP on loopback, continuous batching, per-token processed
log-probs); the baseline is transformers' `generate` on the same 32 prompts as one left-padded batch
in this process, with the same torch thread count, plain and with per-step scores (what it takes to
get log-probs). A fourth row runs the engine's scheduler in this process without HTTP, to separate
the batching core from the serving overhead. Every request makes exactly 64 tokens (`ignore_eos` / no
EOS). The cases alternate round by round (the engine idles while the others run); the table shows
medians of `--repeats` rounds.

    .venv/bin/python bench/engine.py [--threads 1] [--repeats 5]
"""

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import Future
from pathlib import Path

import aiohttp
import torch

from molt_hpc.config import load_config, to_toml
from molt_hpc.engine.batch import ModelRunner, Row
from molt_hpc.engine.client import generate
from molt_hpc.engine.sampling import SamplingParams
from molt_hpc.engine.scheduler import Scheduler
from molt_hpc.models import build_tiny, load_causal_lm
from molt_hpc.rundir import create_run_dir

REPO = Path(__file__).resolve().parents[1]
N, NEW = 32, 64


def start_engine(run, threads: int = 1, timeout_s: float = 120.0) -> tuple[subprocess.Popen, str]:
    """One engine process for the run directory `run`; returns it and its URL once it has registered."""
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "jobs" / "engine.py"), str(run.path), "--role", "engine", "--index", "0"],
        stdout=subprocess.DEVNULL,
        stderr=open(run.logs / "engine-0.log", "wb"),  # noqa: SIM115 - the child owns it
        env={**os.environ, "OMP_NUM_THREADS": str(threads)},
    )
    path = run.rendezvous / "engine-0.json"
    for _ in range(int(timeout_s * 10)):
        if path.exists() and json.loads(path.read_text())["pid"] == proc.pid:
            return proc, json.loads(path.read_text())["url"]
        if proc.poll() is not None:
            raise SystemExit(f"engine died:\n{(run.logs / 'engine-0.log').read_text()}")
        time.sleep(0.1)
    raise SystemExit("engine did not start")


def prompts() -> list[list[int]]:
    """32 prompts of 8..39 tokens (the tiny vocabulary has 104 ids; 4 are specials)."""
    return [[4 + (i * 7 + j * 13) % 100 for j in range(8 + i)] for i in range(N)]


async def engine_round(url: str, token: str) -> float:
    sp = {"max_tokens": NEW, "ignore_eos": True, "temperature": 1.0, "top_k": 0}
    async with aiohttp.ClientSession() as s:
        t0 = time.perf_counter()
        out = await asyncio.gather(*[generate(s, url, p, sp, token=token) for p in prompts()])
        dt = time.perf_counter() - t0
    assert all(len(o.token_ids) == NEW for o in out)
    return dt


def core_round(model) -> float:
    """The engine's scheduler in this process, without HTTP: the batching core on its own."""
    sched = Scheduler(ModelRunner(model, torch.device("cpu")), eos_ids=set(), max_batch=64, max_model_len=512, seed=0)
    sp = SamplingParams(max_tokens=NEW, ignore_eos=True)
    rows = [Row(p, sp, Future()) for p in prompts()]
    t0 = time.perf_counter()
    for row in rows:
        sched.submit(row)
    while sched.rows or sched.waiting:
        sched._step()
    dt = time.perf_counter() - t0
    assert all(len(r.tokens) == NEW for r in rows)
    return dt


def hf_round(model, scores: bool) -> float:
    ps = prompts()
    width = max(map(len, ps))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in ps])
    mask = (torch.arange(width)[None, :] >= torch.tensor([width - len(p) for p in ps])[:, None]).long()
    t0 = time.perf_counter()
    out = model.generate(
        ids,
        attention_mask=mask,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        max_new_tokens=NEW,
        min_new_tokens=NEW,
        eos_token_id=None,
        pad_token_id=0,
        output_scores=scores,
        return_dict_in_generate=scores,
    )
    dt = time.perf_counter() - t0
    seqs = out.sequences if scores else out
    assert seqs.shape == (N, width + NEW)
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the engine and of the baseline")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="bench-engine-") as tmp:
        cfg = load_config(None)
        model_dir = build_tiny(Path(tmp) / "tiny", cfg.model.tiny)
        cfg = load_config(None, [f"model.path={json.dumps(str(model_dir))}", f"engines.threads={args.threads}"])
        run = create_run_dir(tmp, "run", to_toml(cfg))
        proc, url = start_engine(run, args.threads)
        model = load_causal_lm(model_dir)
        engine_s, core_s, hf_s, hf_scores_s = [], [], [], []
        try:
            asyncio.run(engine_round(url, run.token()))  # warm-ups
            hf_round(model, False)
            for _ in range(args.repeats):  # interleaved, so load from other processes hits all cases alike
                engine_s.append(asyncio.run(engine_round(url, run.token())))
                core_s.append(core_round(model))
                hf_s.append(hf_round(model, False))
                hf_scores_s.append(hf_round(model, True))
        finally:
            proc.terminate()
            proc.wait()
    tokens = N * NEW
    base = tokens / statistics.median(hf_s)
    print(f"{N} requests × {NEW} new tokens, tiny model (h128/L2), {args.threads} thread(s), median of {args.repeats}")
    print(f"| {'case':<42} | {'seconds':>8} | {'tokens/s':>9} | {'vs HF generate':>14} |")
    print(f"|{'-' * 44}|{'-' * 10}|{'-' * 11}|{'-' * 16}|")
    for name, times in [
        ("HF generate (one padded batch)", hf_s),
        ("HF generate + output_scores", hf_scores_s),
        ("engine over HTTP (32 concurrent requests)", engine_s),
        ("engine scheduler in-process, no HTTP", core_s),
    ]:
        med = statistics.median(times)
        print(f"| {name:<42} | {med:8.3f} | {tokens / med:9.0f} | {tokens / med / base:13.2f}x |")


if __name__ == "__main__":
    main()
