"""Engine tokens/s on a GPU: 64 concurrent requests × 256 new tokens, Qwen2-0.5B shape, bf16, next to HF
`generate` on the same batch in the same run.

- baseline: HF `generate` over the 64 prompts (128 tokens each) as one left-padded batch, sampling
  (`top_k=0`), exactly 256 new tokens, on GPU 0;
- the engine as its own process (`jobs/engine.py`, HTTP on loopback, continuous batching, processed
  log-probs, CUDA graphs for decode) on GPU 1 (GPU 0 when there is one), 64 concurrent requests; it
  loads while HF runs;
- the engine's scheduler in this process without HTTP: eager; CUDA graphs with sampling outside them
  (the path before sampling moved into the graph); sampling inside the graph; and fused projections
  on top: tokens/s and the decode step's time against its memory-bandwidth floor (weights + the K/V it
  reads, over the measured device-copy bandwidth);
- the engine's log-probs against the trainer's recompute (`molt_hpc.algorithm.token_logprobs`
  over a bf16 forward of prompt + completion): max and mean absolute difference.

    python bench/gpu_engine.py [--out rows.jsonl] [--dry-run]
"""

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import Future
from pathlib import Path

import aiohttp
import torch
from gpu_common import build_model, gpu_env, hbm_bandwidth, sync, timed, write_row

from molt_hpc.config import load_config, to_toml
from molt_hpc.engine.client import generate
from molt_hpc.engine.sampling import SamplingParams
from molt_hpc.rundir import create_run_dir

REPO = Path(__file__).resolve().parents[1]


def start_engine(run, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(REPO / "jobs" / "engine.py"), str(run.path), "--role", "engine", "--index", "0"],
        stdout=subprocess.DEVNULL,
        stderr=open(run.logs / "engine-0.log", "wb"),
        env=env,
    )


def engine_url(run, proc: subprocess.Popen, timeout: float = 300) -> str:
    path = run.rendezvous / "engine-0.json"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and json.loads(path.read_text())["pid"] == proc.pid:
            return json.loads(path.read_text())["url"]
        if proc.poll() is not None:
            raise SystemExit(f"engine died:\n{(run.logs / 'engine-0.log').read_text()[-3000:]}")
        time.sleep(0.2)
    raise SystemExit("engine did not start")


async def http_round(url: str, token: str, prompts: list[list[int]], new: int):
    sp = {"max_tokens": new, "ignore_eos": True, "temperature": 1.0, "top_k": 0}
    async with aiohttp.ClientSession() as s:
        t0 = time.perf_counter()
        out = await asyncio.gather(*[generate(s, url, p, sp, token=token) for p in prompts])
        dt = time.perf_counter() - t0
    assert all(len(o.token_ids) == new for o in out)
    return dt, out


def hf_generate(model, prompts: list[list[int]], new: int, device) -> float:
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
    mask = (ids != -1).long()
    for i, p in enumerate(prompts):
        mask[i, : width - len(p)] = 0

    def run(n):
        return model.generate(
            ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, max_new_tokens=n,
            min_new_tokens=n, eos_token_id=None, pad_token_id=0,
        )  # fmt: skip

    run(2)  # warm-up
    sync(device)
    t0 = time.perf_counter()
    out = run(new)
    sync(device)
    assert out.shape == (len(prompts), width + new)
    return time.perf_counter() - t0


def core_round(runner, prompts: list[list[int]], new: int) -> tuple[float, list[float]]:
    """The engine's scheduler in this process: (seconds, per-step seconds of the pure decode steps)."""
    from molt_hpc.engine.batch import Row
    from molt_hpc.engine.scheduler import Scheduler

    sched = Scheduler(runner, eos_ids=set(), max_batch=len(prompts), max_model_len=runner.slots.capacity, seed=0)
    sp = SamplingParams(max_tokens=new, ignore_eos=True, top_k=0)
    rows = [Row(p, sp, Future()) for p in prompts]
    steps = []
    t0 = time.perf_counter()
    for row in rows:
        sched.submit(row)
    while sched.rows or sched.waiting:
        prefill = bool(sched.waiting)
        s0 = time.perf_counter()
        sched._step()  # ends with the step's read-back of the sampled tokens: synchronous
        if not prefill:
            steps.append(time.perf_counter() - s0)
    dt = time.perf_counter() - t0
    assert all(len(r.tokens) == new for r in rows)
    return dt, steps


def step_parts(runner, n: int, position: int, device) -> tuple[float, float]:
    """Median seconds of one recorded decode step's replay, and of sampling its logits (with the read-back)."""
    from molt_hpc.engine.batch import Row, sample_rows

    rows = [Row([1], SamplingParams(), Future()) for _ in range(n)]
    rng = random.Random(0)
    replay, sampling = [], []
    for _ in range(20):
        replay.append(timed(lambda: runner.decode(runner.slots, [1] * n, [position] * n), device))
        logits = runner.decode(runner.slots, [1] * n, [position] * n)
        sampling.append(timed(lambda out=logits: sample_rows(rows, out, [r.bits(rng) for r in rows]), device))
    return statistics.median(replay), statistics.median(sampling)


def step_floor(model, rows: int, width: int, bandwidth: float) -> float:
    """Seconds of one decode step if it only read the weights and the attended K/V once."""
    c = model.config
    head_dim = c.hidden_size // c.num_attention_heads
    weights = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
    kv = c.num_hidden_layers * 2 * rows * width * c.num_key_value_heads * head_dim * 2
    return (weights + kv) / bandwidth


def logprob_diff(model, prompts, outs, device, chunk: int = 16) -> tuple[float, float]:
    """Max and mean |engine log-prob − trainer recompute| over every generated token."""
    from molt_hpc.algorithm import token_logprobs

    diffs = []
    for s in range(0, len(prompts), chunk):
        seqs = [p + o.token_ids for p, o in zip(prompts[s : s + chunk], outs[s : s + chunk], strict=True)]
        ids = torch.tensor(seqs, device=device)
        with torch.no_grad():
            logp, _ = token_logprobs(model(input_ids=ids).logits, ids)
        for row, p, o in zip(logp, prompts[s : s + chunk], outs[s : s + chunk], strict=True):
            diffs.append((row[len(p) :].float().cpu() - torch.tensor(o.logprobs)).abs())
    d = torch.cat(diffs)
    return float(d.max()), float(d.mean())


VARIANTS = {
    "eager": {},
    "CUDA graphs, sampling outside (before)": {"graphs": True},
    "CUDA graphs + sampling in the graph": {"graphs": True, "sampling": True},
    "CUDA graphs + sampling in the graph + fused projections": {"graphs": True, "sampling": True, "fuse": True},
    "the above + compiled step (engines.compile_decode)": {
        "graphs": True,
        "sampling": True,
        "fuse": True,
        "compile": "inductor",
    },
}
"""Each change on top of the one before (the fused variants change the model's modules in place, for good)."""


def in_process(model, prompts, new: int, device, bandwidth: float, hf_s: float, out, dry: bool) -> None:
    """The scheduler in this process, each variant in turn: tokens/s against HF generate and the decode
    step against its floor."""
    from molt_hpc.engine.slots import SlotRunner

    n, prompt_len, tokens = len(prompts), len(prompts[0]), len(prompts) * new
    base_step = None
    for name, flags in ({"eager": {}} if dry else VARIANTS).items():
        runner = SlotRunner(model, device, max_batch=n, max_model_len=512, **flags)
        t0 = time.perf_counter()
        core_round(runner, prompts, 8 if not flags else new)  # warm-up (graphs: records every bucket)
        warm = time.perf_counter() - t0
        dt, steps = core_round(runner, prompts, new)
        last = "compile" in flags or (dry and not flags)
        write_row(out, bench="engine", case=f"engine scheduler in-process, {name}", value=tokens / dt,
                  unit="tok/s", baseline=n * new / hf_s, ratio=hf_s / dt, target=">= 25x" if last else None,
                  note=f"warm-up round (compile, captures) {warm:.1f} s")  # fmt: skip
        floor = step_floor(model, n, prompt_len + new // 2, bandwidth)  # at the mean attended width
        step = statistics.median(steps)
        base_step = base_step if base_step is not None or not flags else step
        write_row(out, bench="engine", case=f"decode step, {n} rows, {name} (baseline: the floor)",
                  value=1000 * step, unit="ms", baseline=1000 * floor, ratio=step / floor,
                  target="<= 5x" if last else None,
                  note=f"copy bandwidth {bandwidth / 1e12:.2f} TB/s r+w; "
                  + (f"{base_step / step:.2f}x faster than graphs before" if base_step else ""))  # fmt: skip
        if flags == {"graphs": True}:
            replay, sampling = step_parts(runner, n, prompt_len + new - 1, device)
            floor_full = step_floor(model, n, prompt_len + new, bandwidth)
            case = f"decode step, {n} rows at {prompt_len + new} columns: the graph replay alone (floor)"
            write_row(out, bench="engine", case=case, value=1000 * replay, unit="ms", baseline=1000 * floor_full,
                      ratio=replay / floor_full, note=f"then sampling: {1000 * sampling:.2f} ms")  # fmt: skip
        del runner


def batch_sweep(model, prompt_len: int, device, bandwidth: float, rows: list[int], out) -> None:
    """The decode step at each batch size, fused graphs without and with the compiled step (the model is
    already fused by `in_process`), against the floor at that batch."""
    from molt_hpc.engine.slots import SlotRunner

    rng, new = random.Random(1), 64
    vocab = model.config.vocab_size
    batches = {n: [[rng.randrange(1, vocab) for _ in range(prompt_len)] for _ in range(n)] for n in rows}
    for compile_ in (None, "inductor"):  # the same prompts for both
        runner = SlotRunner(model, device, max_batch=max(rows), max_model_len=512, graphs=True, sampling=True,
                            fuse=True, compile=compile_)  # fmt: skip
        for n, prompts in batches.items():
            core_round(runner, prompts, 8)  # records this batch's buckets
            _, steps = core_round(runner, prompts, new)
            floor = step_floor(model, n, prompt_len + new // 2, bandwidth)
            step = statistics.median(steps)
            label = "compiled" if compile_ else "not compiled"
            write_row(out, bench="engine", case=f"decode step, {n} rows, fused graphs, {label} (baseline: the floor)",
                      value=1000 * step, unit="ms", baseline=1000 * floor, ratio=step / floor,
                      target="<= 5x" if compile_ and n == 64 else None)  # fmt: skip
        del runner


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--dry-run", action="store_true", help="tiny shape on the CPU: checks the script")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 256], help="batch sizes of the step sweep")
    args = ap.parse_args()
    dry = args.dry_run
    gpus = torch.cuda.device_count()
    if not dry and gpus < 1:
        print("gpu_engine: needs a CUDA GPU; --dry-run on a CPU")
        return 0
    shape, n, prompt_len, new = ("tiny", 8, 8, 16) if dry else ("0.5b", 64, 128, 256)
    device = torch.device("cpu" if dry else "cuda:0")
    dtype = torch.float32 if dry else torch.bfloat16
    rng = random.Random(0)
    tmp = Path(tempfile.mkdtemp(prefix="bench-gpu-engine-"))
    model = build_model(shape, dtype, device, seed=0, tied=True)
    vocab = model.config.vocab_size
    prompts = [[rng.randrange(1, vocab) for _ in range(prompt_len)] for _ in range(n)]
    model.save_pretrained(tmp / "model", safe_serialization=True)
    sets = [f"model.path={json.dumps(str(tmp / 'model'))}", f"model.dtype='{str(dtype)[6:]}'",
            f"engines.max_batch={n}", "engines.max_model_len=512", f"engines.device='{device.type}'",
            "engines.compile_decode=true"]  # fmt: skip
    hf_s = hf_generate(model, prompts, new, device)
    tokens = n * new
    hf_tps = tokens / hf_s
    write_row(args.out, bench="engine", case=f"HF generate, {n} x {new} new tokens (baseline)", value=hf_tps,
              unit="tok/s", note=f"{hf_s:.2f} s, {1000 * hf_s / new:.1f} ms per step")  # fmt: skip
    # In-process rows first: each row is written as it is measured, so a run cut short keeps them.
    bandwidth = hbm_bandwidth(device) if not dry else 50e9
    in_process(model, prompts, new, device, bandwidth, hf_s, args.out, dry)
    if not dry:
        batch_sweep(model, prompt_len, device, bandwidth, args.rows, args.out)
    run = create_run_dir(tmp, "run", to_toml(load_config(None, sets)))
    # The engine's own GPU when there are two; with one it shares it.
    proc = start_engine(run, {**gpu_env(), "CUDA_VISIBLE_DEVICES": "1" if gpus > 1 else "0"} if not dry else gpu_env())
    try:
        url = engine_url(run, proc)
        asyncio.run(http_round(url, run.token(), prompts, new))  # warm-up: compiles and records the decode graphs
        rounds = [asyncio.run(http_round(url, run.token(), prompts, new)) for _ in range(2)]
    finally:
        proc.terminate()
        proc.wait()
    http_s = statistics.median(r[0] for r in rounds)
    mode = "eager (CPU)" if dry else "CUDA graphs, compiled step"
    write_row(args.out, bench="engine", case=f"engine process, HTTP, {n} concurrent, {mode}", value=tokens / http_s,
              unit="tok/s", baseline=hf_tps, ratio=hf_s / http_s, target=">= 20x")  # fmt: skip
    mx, mean = logprob_diff(model, prompts, rounds[-1][1], device)
    write_row(args.out, bench="engine", case=f"log-probs, engine vs trainer recompute ({str(dtype)[6:]})",
              value=mx, unit="max abs", note=f"mean abs {mean:.2e} over {tokens} tokens")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
