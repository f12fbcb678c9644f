"""Where one prefill of the built-in engine spends its time, SmolLM2-135M shape, one GPU.

For a few (rows, longest prompt) sizes, each prefill path of `SlotRunner` is timed with the device
synchronised around each call (median of `--repeat` calls after warm-up):

- `dynamic`: the transformers forward over a left-padded batch into a `DynamicCache` with a 2-D mask,
  then the copy of that cache into the slot cache (`join`): the path before prefill wrote the slots;
- `slots`: right-padded rows written straight into the slot cache, causal attention, no mask;
- `graphs`: the same, replayed from CUDA graphs bucketed by (rows, length).

and profiled with `torch.profiler` over the same calls: host time (the ops' self CPU time and the wall
time of the calls) against device time (the kernels' total), kernels per prefill, and the costliest
ops. Rows go to `--out` (JSONL), the op tables to `--table`.

    python bench/gpu_prefill.py [--out rows.jsonl] [--table ops.txt] [--paths dynamic,slots,graphs] [--dry-run]
"""

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch
from gpu_common import bench_device, sync, write_row
from gpu_rollout import smollm2

SIZES = ((1, 70), (2, 100), (4, 100), (16, 100), (64, 100), (128, 100))
"""(rows, longest prompt): prompts are 40 tokens up to the longest, the recipe's range."""


def runner_for(path: str, model, device, dry: bool):
    from molt_hpc.engine.slots import SlotRunner

    flags = {} if dry else {"graphs": True, "sampling": True, "fuse": True}
    if path != "dynamic":
        flags["slot_prefill"] = True
        flags["prefill_graphs"] = path == "graphs" and not dry
    elif "slot_prefill" in SlotRunner.__init__.__code__.co_varnames:
        flags["slot_prefill"] = False
    return SlotRunner(model, device, max_batch=128, max_model_len=256, **flags)


def one_call(runner, contexts, device) -> tuple[float, float]:
    """(prefill seconds, join seconds) of one prefill of `contexts` into an empty batch."""
    sync(device)
    t0 = time.perf_counter()
    _, part = runner.prefill(contexts, [None] * len(contexts))
    sync(device)
    t1 = time.perf_counter()
    runner.join(None, part)
    sync(device)
    t2 = time.perf_counter()
    runner.slots.clear()
    return t1 - t0, t2 - t1


def profiled(runner, contexts, device, calls: int):
    """(host ms, device ms, kernels) per call under torch.profiler, and its op table."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(calls):
            one_call(runner, contexts, device)
    events = prof.key_averages()
    host = sum(e.self_cpu_time_total for e in events) / 1000 / calls
    dev = sum(getattr(e, "self_device_time_total", 0) for e in events if e.device_type.name != "CPU") / 1000 / calls
    kernels = sum(e.count for e in events if e.device_type.name != "CPU") / calls
    table = events.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60)
    return host, dev, kernels, table


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--table", type=Path, help="append each size's op table here")
    ap.add_argument("--paths", default="dynamic,slots,graphs")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--dry-run", action="store_true", help="tiny shape on the CPU: checks the script")
    args = ap.parse_args()
    dry = args.dry_run
    device = bench_device("gpu_prefill", dry)
    if device is None:
        return 0
    model = smollm2(device, torch.float32 if dry else torch.bfloat16, dry)
    rng = random.Random(0)
    vocab = model.config.vocab_size
    for path in args.paths.split(","):
        runner = runner_for(path, model, device, dry)
        for rows, longest in SIZES:
            contexts = [[rng.randrange(1, vocab) for _ in range(rng.randint(40, longest))] for _ in range(rows)]
            contexts[0] = contexts[0][:40] + [1] * (longest - 40)  # the longest is in every call
            t0 = time.perf_counter()
            one_call(runner, contexts, device)  # the first call of a shape records its graphs
            first = time.perf_counter() - t0
            for _ in range(3):
                one_call(runner, contexts, device)
            times = [one_call(runner, contexts, device) for _ in range(args.repeat)]
            host, dev, kernels, table = profiled(runner, contexts, device, 5)
            tokens = sum(map(len, contexts))
            prefill_ms = 1000 * statistics.median(t[0] for t in times)
            join_ms = 1000 * statistics.median(t[1] for t in times)
            write_row(args.out, bench="prefill", case=f"{path}, {rows} rows x <= {longest} tokens", path=path,
                      rows=rows, longest=longest, tokens=tokens, value=prefill_ms + join_ms, unit="ms",
                      prefill_ms=prefill_ms, join_ms=join_ms, first_call_s=first, host_ms=host, device_ms=dev,
                      kernels=kernels, note=f"profiler: ops' self CPU {host:.2f} ms, kernels {dev:.2f} ms "
                      f"({kernels:.0f}) a call")  # fmt: skip
            if args.table:
                with open(args.table, "a") as f:
                    f.write(f"== {path}, {rows} rows x <= {longest} tokens ==\n{table}\n")
        del runner
    return 0


if __name__ == "__main__":
    sys.exit(main())
