"""The cost of `actor.offload` on one GPU: trainer step time and memory with none / optimizer / full.

One run, one process, a world of one on GPU 0. A random-weight Qwen2 of the chosen shape (0.5B by
default) is written once as bf16 safetensors; each mode then builds the policy the trainer's way
(`build.load_model`: meta device, FSDP2, sharded load; `build_optimizer` with the mode's offload)
and runs `train_step` on one group of `--rows` samples of `--seq` tokens, bf16 compute, fp32
masters. Reported per mode: median step seconds over 3 timed steps after 2 warm-up steps, against
`none` measured in the same run (the ratio is the slowdown), and in the note the step's GPU peak
(allocated, what `metrics.jsonl` logs), the GPU memory held between steps (parameters + optimizer
state: what offload frees), the host peak RSS and the load time.

    python bench/gpu_offload.py [--shape 0.5b|1.5b] [--seq 2048] [--rows 4] [--out rows.jsonl] [--dry-run]
"""

import argparse
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from gpu_common import build_model, sync, write_row
from gpu_train import make_group

MODES = ["none", "optimizer", "full"]
WARMUP, TIMED = 2, 3


def write_checkpoint(shape: str, out: Path, device) -> Path:
    model = build_model(shape, torch.bfloat16, device, seed=0)
    model.save_pretrained(out, max_shard_size="2GB")
    del model
    return out


def bench_mode(mode: str, path: Path, world, args) -> dict:
    from molt_hpc.actor import build
    from molt_hpc.actor.memory import StepMemory
    from molt_hpc.actor.state import Trainable
    from molt_hpc.actor.step import Models, train_step
    from molt_hpc.config import load_config

    sets = [f"model.path='{path}'", f"actor.offload='{mode}'", f"actor.device='{world.device.type}'",
            "model.dtype='bfloat16'", f"rollout.max_total_tokens={args.seq}", f"engines.max_model_len={args.seq}",
            f"data.max_prompt_tokens={args.seq // 8}", f"actor.micro_batch_size={args.rows}", "actor.lr=1e-5",
            "algorithm.kl_coef=0.0"]  # fmt: skip
    cfg = load_config(None, sets)
    t0 = time.perf_counter()
    model = build.load_model(path, cfg, world, "policy")
    opt = build.build_optimizer(model, cfg.actor, cfg.actor.lr)
    load_s = time.perf_counter() - t0
    models = Models(policy=Trainable("policy", model, opt, build.build_scheduler(opt, cfg.actor, 10**6)))
    group = make_group(args.rows, args.seq, args.seq // 8, model.config.vocab_size)
    memory, times, peaks = StepMemory(world.device), [], {}
    for i in range(WARMUP + TIMED):
        sync(world.device)
        memory.start()
        t0 = time.perf_counter()
        train_step([group], cfg, models, world, pad_id=0)
        sync(world.device)
        if i >= WARMUP:
            times.append(time.perf_counter() - t0)
            peaks = memory.peaks()
    cuda = world.device.type == "cuda"
    held = torch.cuda.memory_allocated(world.device) / 1e9 if cuda else 0.0
    del models, model, opt
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return {"step_s": statistics.median(times), "held_gb": held, "load_s": load_s, **peaks}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="0.5b")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--dry-run", action="store_true", help="tiny shape on the CPU: checks the script")
    args = ap.parse_args()
    from molt_hpc.actor.world import init_world
    from molt_hpc.config.train import ActorConfig

    if args.dry_run:
        args.shape, args.seq, args.rows = "tiny", 64, 2
    elif not torch.cuda.is_available():
        print("gpu_offload: needs a CUDA GPU; --dry-run on a CPU")
        return 0
    world = init_world(ActorConfig(device="cpu" if args.dry_run else "cuda"))
    with tempfile.TemporaryDirectory(prefix="bench-offload-") as tmp:
        path = write_checkpoint(args.shape, Path(tmp) / args.shape, world.device)
        results = {mode: bench_mode(mode, path, world, args) for mode in MODES}
    base = results["none"]["step_s"]
    for mode, r in results.items():
        gpu = ""
        if "mem_peak_allocated_gb" in r:  # a GPU run (the dry run has no GPU allocator to report)
            gpu = f"GPU peak {r['mem_peak_allocated_gb']:.1f} GB, held between steps {r['held_gb']:.1f} GB, "
        note = gpu + f"host peak RSS {r.get('mem_peak_host_rss_gb', 0):.1f} GB, load {r['load_s']:.1f} s"
        write_row(args.out, bench="offload", case=f"{args.shape}, {args.rows}x{args.seq} tokens, offload={mode}",
                  value=r["step_s"], unit="s/step", baseline=base, ratio=r["step_s"] / base,
                  note=note)  # fmt: skip
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
