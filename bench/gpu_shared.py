"""The built-in engine on a GPU it shares with the trainer: its decode step alone and beside a training process.

An asynchronous run with both pools on one GPU decodes the next step's samples while the trainer trains. This
bench times the engine's step, at a full batch of rows (`engines.max_batch`, at most 128) of the config's model
with random weights, four ways:

- in this process, the scheduler stepped directly (what `plan --calibrate` times): alone, then while a second
  process trains the config's own step in a loop on the same GPU (`molt_hpc.plan.calibrate_shared`);
- the engine process over HTTP on loopback, every row a request of `rollout.max_new_tokens` tokens, whole
  answers and streamed ones (what the rollout asks for): alone, then beside the same training process;

and both once more alone after the training process has gone, so that drift between the phases shows. The
engine process captures a CUDA graph for each batch size its rounds reach, on first use (about 0.2 s each on
an H200): a round of 8-token answers for each batch size, then rounds of both kinds, run untimed first, and
each HTTP row counts the captures that still fell inside it.

Over HTTP a step is the round's wall time over the engine's steps in it (its `/health` counter); in-process it
is each decode step's own time. The training process reports its step alone, beside the in-process decoding
and beside the engine process serving over HTTP (each a step that ran wholly inside that phase).

    python bench/gpu_shared.py configs/smollm2_math_gpu.toml --set model.path=DIR [--seconds 4] [--out rows.jsonl]
    python bench/gpu_shared.py configs/tiny_cpu.toml --dry-run
"""

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import torch
from gpu_common import bench_device, gpu_env, write_row
from gpu_engine import engine_url, start_engine
from gpu_rollout import http_round

from molt_hpc.config import load_config, to_toml
from molt_hpc.engine.client import health
from molt_hpc.plan.calibrate_shared import TrainerProcess, decode_steps
from molt_hpc.plan.calibrate_train import random_model
from molt_hpc.rundir import create_run_dir


async def engine_steps(url: str, token: str) -> int:
    async with aiohttp.ClientSession() as s:
        return int((await health(s, url, token=token))["steps"])


def http_rounds(url: str, token: str, requests, streamed: bool, seconds: float) -> tuple[float, int, int]:
    """(wall seconds, engine steps, tokens) of rounds of `requests` over at least `seconds`."""
    wall, tokens, start = 0.0, 0, asyncio.run(engine_steps(url, token))
    while wall < seconds:
        dt, n = asyncio.run(http_round(url, token, requests, streamed))
        wall, tokens = wall + dt, tokens + n
    return wall, asyncio.run(engine_steps(url, token)) - start, tokens


def captures(log: Path) -> int:
    """CUDA graphs the engine process has captured so far (its log's lines): a capture inside a timed round
    is start-up work in that round's time."""
    return log.read_text(errors="replace").count("captured the ") if log.exists() else 0


def http_rows(args, url: str, token: str, requests, label: str, seconds: float, log: Path) -> dict[str, float]:
    """Seconds of an engine step over HTTP, whole answers and streamed ones (the keys)."""
    out = {}
    for kind in ("whole", "streamed"):
        before = captures(log)
        wall, steps, tokens = http_rounds(url, token, requests, kind == "streamed", seconds)
        case = f"engine process, HTTP, {kind}, {label}"
        note = f"{steps} steps, {tokens / wall:,.0f} tok/s, {len(requests)} requests a round"
        note += f", {captures(log) - before} graph captures in it"
        write_row(args.out, bench="shared", case=case, value=1000 * wall / steps, unit="ms/step", note=note)
        out[kind] = wall / steps
    return out


def decode_row(args, steps: list[float], label: str, rows: int) -> float:
    mean, median = statistics.fmean(steps), statistics.median(steps)
    write_row(args.out, bench="shared", case=f"in-process scheduler, {label}", value=1000 * mean, unit="ms/step",
              note=f"{len(steps)} decode steps of {rows} rows, median {1000 * median:.2f} ms")  # fmt: skip
    return mean


def warm_sizes(rows: int) -> list[int]:
    """Request counts of the warm-up rounds: every prefill bucket up to `rows` (a power of two up to 8, then
    multiples of 8: `engine.prefill.rows_bucket`), which covers the decode buckets (`engine.graphs.batch_bucket`)
    where a round's requests are admitted together."""
    return sorted({n for n in (1, 2, 4, *range(8, rows + 1, 8)) if n <= rows} | {rows})


def start_engine_process(args, cfg, model, device):
    tmp = Path(tempfile.mkdtemp(prefix="bench-gpu-shared-"))
    model.save_pretrained(tmp / "model", safe_serialization=True)
    sets = [*args.sets, f"model.path={json.dumps(str(tmp / 'model'))}", f"engines.device='{device.type}'"]
    run = create_run_dir(tmp, "run", to_toml(load_config(args.config, sets)))
    proc = start_engine(run, gpu_env())
    return proc, engine_url(run, proc), run.token(), run.logs / "engine-0.log"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--seconds", type=float, default=4.0, help="decoding timed per case (at least)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--dry-run", action="store_true", help="on the CPU: checks the script")
    args = ap.parse_args()
    device = bench_device("gpu_shared", args.dry_run)
    if device is None:
        return 0
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    cfg = load_config(args.config, args.sets)
    model, _ = random_model(cfg, device)
    rows = max(8, min(cfg.engines.max_batch, 128))
    rng = random.Random(0)
    vocab = model.config.get_text_config().vocab_size
    requests = [([rng.randrange(4, vocab) for _ in range(64)], cfg.rollout.max_new_tokens) for _ in range(rows)]
    proc, url, token, log = start_engine_process(args, cfg, model, device)
    try:
        from molt_hpc.engine.main import model_runner

        eng = cfg.engines.model_copy(update={"max_batch": rows, "max_model_len": 64 + 40})
        runner = model_runner(model.eval(), device, eng, None, graphs=True)
        decode_steps(runner, rows, 64, 0.0, sync)  # records the graphs
        for n in warm_sizes(rows):  # the engine process's graphs: a round of each batch size's requests at once
            asyncio.run(http_round(url, token, [(prompt, 8) for prompt, _ in requests[:n]], False))
        for streamed in (False, True):  # and of the batch sizes that full rounds reach
            http_rounds(url, token, requests, streamed, args.seconds / 2)
        alone = decode_row(args, decode_steps(runner, rows, 64, args.seconds, sync), "alone", rows)
        http_alone = http_rows(args, url, token, requests, "alone", args.seconds, log)
        t0 = time.perf_counter()
        trainer = TrainerProcess(cfg, device.type)
        print(f"trainer process ready in {time.perf_counter() - t0:.1f} s", flush=True)
        window = max(args.seconds, 3 * max(trainer.alone))
        trainer.beside(True)
        steps = decode_steps(runner, rows, 64, window, sync, more=lambda: trainer.poll() < 1)
        trainer.beside(False)
        shared = decode_row(args, steps, "beside the trainer", rows)
        trainer.poll()
        beside_decode = list(trainer.shared)
        trainer.beside(True)
        http_shared = http_rows(args, url, token, requests, "beside the trainer", window, log)
        trainer.beside(False)
        beside_http = trainer.finish()[len(beside_decode) :]
        # alone again once the trainer process is gone: drift between the phases shows as a change here
        after = decode_row(args, decode_steps(runner, rows, 64, args.seconds, sync), "alone, after", rows)
        http_after = http_rows(args, url, token, requests, "alone, after", args.seconds, log)
    finally:
        proc.terminate()
        proc.wait()
    rate_row(args, "in-process", [alone, after], shared)
    for kind, step in http_shared.items():
        rate_row(args, f"HTTP, {kind}", [http_alone[kind], http_after[kind]], step)
    ta = statistics.fmean(trainer.alone)
    for label, beside in (("the in-process decoding", beside_decode), ("the engine process over HTTP", beside_http)):
        tb = statistics.fmean(beside) if beside else float("nan")
        note = f"{len(beside)} steps; alone {1000 * ta:.1f} ms ({len(trainer.alone)} steps): {tb / ta:.2f}x"
        write_row(args.out, bench="shared", case=f"trainer step beside {label}", value=1000 * tb, unit="ms", note=note)
    return 0


def rate_row(args, label: str, alone: list[float], beside: float) -> None:
    """The engine's decode rate beside the trainer: its step alone (before and after) over its step beside."""
    before, after = alone
    write_row(args.out, bench="shared", case=f"decode rate beside the trainer ({label})",
              value=statistics.fmean(alone) / beside, unit="x alone",
              note=f"against the step alone before {before / beside:.2f}, after {after / beside:.2f}")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
