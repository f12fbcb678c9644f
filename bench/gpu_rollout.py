"""The built-in engine under the SmolLM2 recipe's rollout load, on one GPU: where its time goes.

The recipe (`configs/smollm2_gym_gpu.toml`) keeps 32 groups x 8 samples in flight against one engine of
128 rows; prompts are ~40-100 tokens and answers stop on their own after a few to 64 tokens, so rows join
and leave at almost every step. This bench replays that load with the SmolLM2-135M shape (random
weights, built from `configs/models/smollm2-135m`; answer lengths drawn from the same range, since random
weights never stop on their own) and reports tokens/s for:

- the scheduler in this process (no HTTP), with the time of each part of its steps: prefill, joining the
  slot cache, the decode step (graph replay and read-back), rows leaving, and the rest (Python), for each
  prefill path (`--prefill`): `dynamic` (a `DynamicCache` forward copied into the slots, the path before
  the slot prefill) and `slots` (straight into the slot cache, from CUDA graphs);
- the engine process over HTTP on loopback, whole answers and streamed answers (what the rollout sends).

The baseline of every row is HF `generate` on the same model: one left-padded batch of 128 prompts,
64 new tokens each, sampled.

    python bench/gpu_rollout.py [--out rows.jsonl] [--requests 256] [--prefill dynamic,slots] [--compile]
        [--seeded] [--set engines.prefill_interval=4] [--dry-run]
"""

import argparse
import asyncio
import cProfile
import io
import json
import pstats
import random
import sys
import tempfile
import time
from collections import defaultdict
from concurrent.futures import Future
from pathlib import Path

import aiohttp
import torch
from gpu_common import bench_device, gpu_env, sync, write_row
from gpu_engine import engine_url, hf_generate, start_engine

from molt_hpc.config import load_config, to_toml
from molt_hpc.engine.client import generate
from molt_hpc.engine.sampling import SamplingParams
from molt_hpc.engine.stream import Partial, generate_streamed
from molt_hpc.rundir import create_run_dir

REPO = Path(__file__).resolve().parents[1]


def smollm2(device, dtype, dry: bool):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(REPO / "configs" / "models" / "smollm2-135m")
    if dry:
        config.update(dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=16, vocab_size=1000))  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def load(n: int, vocab: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """(prompt, answer length) of `n` requests: the recipe's prompt and answer length ranges."""
    rng = random.Random(seed)
    return [([rng.randrange(1, vocab) for _ in range(rng.randint(40, 100))], rng.randint(8, 64)) for _ in range(n)]


class PartTimer:
    """Wraps the runner's and slot cache's methods to add up the seconds each takes (synchronised)."""

    def __init__(self, runner, device):
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.wrapped = ((runner, "prefill", "prefill"), (runner, "join", "join"), (runner, "decode_sampled", "decode"),
                        (runner, "decode", "decode"), (runner.slots, "keep", "leave"))  # fmt: skip
        for obj, name, part in self.wrapped:
            setattr(obj, name, self._wrap(getattr(obj, name), part, device))

    def remove(self) -> None:
        """Back to the untimed methods (the class's, which the instance's wrappers shadowed)."""
        for obj, name, _ in self.wrapped:
            delattr(obj, name)

    def _wrap(self, fn, part, device):
        def timed(*args, **kwargs):
            sync(device)
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            sync(device)
            self.seconds[part] += time.perf_counter() - t0
            self.calls[part] += 1
            return out

        return timed


def core_round(runner, requests, max_batch: int, profile: bool = False, interval: int = 1):
    """All requests through the scheduler in this process, `max_batch` rows at most: (seconds, tokens, steps,
    cProfile text or None)."""
    from molt_hpc.engine.batch import Row
    from molt_hpc.engine.scheduler import Scheduler

    sched = Scheduler(runner, eos_ids=set(), max_batch=max_batch, max_model_len=runner.slots.capacity, seed=0,
                      prefill_interval=interval)  # fmt: skip
    rows = [Row(p, SamplingParams(max_tokens=m, ignore_eos=True, top_k=0), Future()) for p, m in requests]
    prof = cProfile.Profile() if profile else None
    t0 = time.perf_counter()
    for row in rows:
        sched.submit(row)
    if prof:
        prof.enable()
    sched.drain()
    if prof:
        prof.disable()
    dt = time.perf_counter() - t0
    assert all(len(r.tokens) == m for r, (_, m) in zip(rows, requests, strict=True))
    text = None
    if prof:
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
        text = buf.getvalue()
    return dt, sum(m for _, m in requests), sched.steps, text


def closed_loop(runner, vocab: int, max_batch: int, interval: int, groups: int = 400, in_flight: int = 16):
    """The recipe's supply: `in_flight` groups of 8 samples of one prompt; a group is replaced only when all 8
    are done (the rollout scores whole groups), answers of 4-20 tokens (the recipe's mean is 11). Returns
    (seconds, tokens, steps)."""
    from molt_hpc.engine.batch import Row
    from molt_hpc.engine.scheduler import Scheduler

    rng = random.Random(1)
    sched = Scheduler(runner, eos_ids=set(), max_batch=max_batch, max_model_len=runner.slots.capacity, seed=0,
                      prefill_interval=interval)  # fmt: skip

    def group() -> list[Row]:
        prompt = [rng.randrange(1, vocab) for _ in range(rng.randint(40, 100))]
        rows = [Row(list(prompt), SamplingParams(max_tokens=rng.randint(4, 20), ignore_eos=True, top_k=0), Future())
                for _ in range(8)]  # fmt: skip
        for row in rows:
            sched.submit(row)
        return rows

    live, started, tokens = [group() for _ in range(in_flight)], in_flight, 0
    t0 = time.perf_counter()
    while live:
        sched._step()
        for rows in [g for g in live if all(r.future.done() for r in g)]:
            live.remove(rows)
            tokens += sum(len(r.tokens) for r in rows)
            if started < groups:
                live.append(group())
                started += 1
    return time.perf_counter() - t0, tokens, sched.steps


async def http_round(url: str, token: str, requests, streamed: bool, seeded: bool = False) -> tuple[float, int]:
    async def one(s, prompt, m):
        sp = {"max_tokens": m, "ignore_eos": True, "temperature": 1.0, "top_k": 0}
        if seeded:
            sp["seed"] = len(prompt) * 1000 + m
        if streamed:
            return await generate_streamed(s, url, prompt, sp, Partial(), token=token)
        return await generate(s, url, prompt, sp, token=token)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        t0 = time.perf_counter()
        out = await asyncio.gather(*[one(s, p, m) for p, m in requests])
        dt = time.perf_counter() - t0
    assert [len(o.token_ids) for o in out] == [m for _, m in requests]
    return dt, sum(m for _, m in requests)


PREFILL_PATHS = {
    "dynamic": {"slot_prefill": False},  # a DynamicCache forward with a 2-D mask, copied into the slots at join
    "slots": {"slot_prefill": True},  # straight into the slot cache, CUDA graphs where the decode has them
}


def engine_rows(args, model, device, flags: dict, path: str, requests, hf_tps: float) -> None:
    """The in-process rows of one prefill path: rounds with each part timed, untimed rounds, the closed loop.
    Every round runs once untimed first: the runs are deterministic, so that records every graph they replay."""
    from molt_hpc.engine.slots import SlotRunner

    tokens, vocab = sum(m for _, m in requests), model.config.vocab_size
    intervals = [int(i) for i in args.intervals.split(",")]
    runner = SlotRunner(model, device, max_batch=args.max_batch, max_model_len=256, **flags)
    t0 = time.perf_counter()
    for interval in intervals:
        core_round(runner, requests, args.max_batch, interval=interval)
    for interval in (1, 8):
        closed_loop(runner, vocab, args.max_batch, interval)
    warm = f"warm-up rounds (graph capture) {time.perf_counter() - t0:.1f} s"
    timer = PartTimer(runner, device)
    for interval in intervals:
        timer.seconds.clear()
        timer.calls.clear()
        dt, _, steps, _ = core_round(runner, requests, args.max_batch, interval=interval)
        parts = ", ".join(f"{k} {1000 * v / steps:.2f} ms ({timer.calls[k]} calls)" for k, v in timer.seconds.items())
        rest = dt - sum(timer.seconds.values())
        case = f"{path} prefill: in-process, prefill_interval {interval}, parts timed"
        write_row(args.out, bench="rollout", case=case,
                  value=tokens / dt, unit="tok/s", baseline=hf_tps, ratio=tokens / dt / hf_tps,
                  note=f"{steps} steps, {1000 * dt / steps:.2f} ms/step: {parts}, rest {1000 * rest / steps:.2f} ms; "
                  f"{warm}")  # fmt: skip
    timer.remove()
    for interval in intervals:
        profile = args.profile is not None and interval == args.interval
        dt, _, steps, prof = core_round(runner, requests, args.max_batch, profile=profile, interval=interval)
        if prof and args.profile:
            args.profile.with_name(f"{args.profile.stem}-{path}{args.profile.suffix}").write_text(prof)
        write_row(args.out, bench="rollout", case=f"{path} prefill: in-process, prefill_interval {interval}",
                  value=tokens / dt, unit="tok/s", baseline=hf_tps, ratio=tokens / dt / hf_tps,
                  note=f"{steps} steps, {1000 * dt / steps:.2f} ms/step")  # fmt: skip
    for interval in (1, 8):
        dt, done, steps = closed_loop(runner, vocab, args.max_batch, interval)
        case = f"{path} prefill: closed loop (16 groups of 8, 4-20 tokens), prefill_interval {interval}"
        write_row(args.out, bench="rollout", case=case, value=done / dt, unit="tok/s", baseline=hf_tps,
                  ratio=done / dt / hf_tps,
                  note=f"{steps} steps, {1000 * dt / steps:.2f} ms/step, {400 * 8 / dt:.0f} requests/s")  # fmt: skip


def http_rows(args: argparse.Namespace, model, device, dtype, requests, tokens: int, hf_tps: float) -> None:
    """The engine process's rows: the model saved, an engine started on it, whole and streamed answers over HTTP."""
    tmp = Path(tempfile.mkdtemp(prefix="bench-gpu-rollout-"))
    model.save_pretrained(tmp / "model", safe_serialization=True)
    sets = [f"model.path={json.dumps(str(tmp / 'model'))}", f"model.dtype='{str(dtype)[6:]}'",
            f"engines.max_batch={args.max_batch}", "engines.max_model_len=256", f"engines.device='{device.type}'",
            "engines.gpu_memory_utilization=0.3", f"engines.prefill_interval={args.interval}",
            f"engines.compile_decode={str(args.compile).lower()}", *args.sets]  # fmt: skip
    run = create_run_dir(tmp, "run", to_toml(load_config(None, sets)))
    proc = start_engine(run, gpu_env())
    try:
        url = engine_url(run, proc)
        for streamed in (False, True, False, True):  # the first of each warms up
            dt, _ = asyncio.run(http_round(url, run.token(), requests, streamed, args.seeded))
        for streamed in (False, True):
            dt, _ = asyncio.run(http_round(url, run.token(), requests, streamed, args.seeded))
            kind = ("streamed" if streamed else "whole") + (", seeded" if args.seeded else "")
            write_row(args.out, bench="rollout", case=f"engine process, HTTP, {kind}",
                      value=tokens / dt, unit="tok/s", baseline=hf_tps, ratio=tokens / dt / hf_tps)  # fmt: skip
    finally:
        proc.terminate()
        proc.wait()


def parse_args() -> argparse.Namespace:
    """The command line: the load, the in-process cases, the engine process's settings."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--requests", type=int, default=256, help="requests in flight (the recipe: 32 groups x 8)")
    ap.add_argument("--max-batch", type=int, default=128, help="engines.max_batch (the recipe's)")
    ap.add_argument("--interval", type=int, default=8, help="engines.prefill_interval of the engine process")
    ap.add_argument("--profile", type=Path, help="write the in-process round's cProfile here")
    ap.add_argument("--no-http", action="store_true", help="leave out the engine process rows")
    ap.add_argument("--compile", action="store_true", help="the compiled decode step (engines.compile_decode)")
    ap.add_argument("--prefill", default="dynamic,slots", help=f"prefill paths in turn: {','.join(PREFILL_PATHS)}")
    ap.add_argument("--intervals", default="1,4,8,16", help="prefill_interval values of the in-process rounds")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override of the engine process (engines.prefill_interval=4, say)")  # fmt: skip
    ap.add_argument("--seeded", action="store_true", help="every request carries a seed, as the rollout's do")
    ap.add_argument("--dry-run", action="store_true", help="tiny shape on the CPU: checks the script")
    return ap.parse_args()


def main() -> int:
    args = parse_args()
    dry = args.dry_run
    device = bench_device("gpu_rollout", dry)
    if device is None:
        return 0
    dtype = torch.float32 if dry else torch.bfloat16
    model = smollm2(device, dtype, dry)
    requests = load(args.requests, model.config.vocab_size)
    tokens = sum(m for _, m in requests)
    print(f"gpu_rollout: {args.requests} requests, {tokens} tokens, max_batch {args.max_batch}", flush=True)

    prompts = [p for p, _ in requests[: args.max_batch]]
    hf_s = hf_generate(model, prompts, 64, device)
    hf_tps = len(prompts) * 64 / hf_s
    write_row(args.out, bench="rollout", case=f"HF generate, {len(prompts)} x 64 new tokens (baseline)",
              value=hf_tps, unit="tok/s", note=f"{hf_s:.2f} s")  # fmt: skip

    flags = {} if dry else {"graphs": True, "sampling": True, "fuse": True}
    if args.compile:
        flags["compile"] = "inductor"
    for path in args.prefill.split(","):
        engine_rows(args, model, device, {**flags, **PREFILL_PATHS[path]}, path, requests, hf_tps)
    if args.no_http:
        return 0
    http_rows(args, model, device, dtype, requests, tokens, hf_tps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
