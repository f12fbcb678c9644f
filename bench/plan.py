"""The planner's trainer peak beside the measured peak of a real trainer step, one table.

Each case builds a Qwen2-shaped model from its config with random weights (fp32 master weights,
bf16 compute, as the trainer does: `parallelize`, `build_optimizer`), runs the trainer's own
`train_step` (rows packed to its token budget, as the trainer runs them) once to create the
optimizer state, resets the peak counters and runs it again. The measured peak is
`torch.cuda.max_memory_allocated` of that second step (its reserved peak beside it, which the plan's
allocator slack covers); the prediction is `molt_hpc.plan`'s from the same config and shape, made
before the model is built. Target: within ±15%.

On one H200 (< 3 min): 0.5B without and with activation checkpointing, 1.5B, 7B (7B's whole fp32
state, 122 GB, on one GPU: checkpointing and 2k-token rows). Without CUDA, or with `--dry-run`, the
same step runs on the CPU at small shapes and torch's memory tracker measures it.

    python bench/plan.py [--cases 0.5b 0.5b-ac 1.5b 7b-ac] [--dry-run]
"""

import argparse
import gc
import random
import sys
import time

import torch

CASES = {  # shape, samples (one group), rows per micro-batch, tokens per row, activation checkpointing
    "0.5b": ("0.5b", 4, 4, 4096, False),
    "0.5b-ac": ("0.5b", 4, 4, 4096, True),
    "1.5b": ("1.5b", 2, 2, 4096, False),
    "7b-ac": ("7b", 2, 1, 2048, True),
}
CPU_CASES = {
    "cpu": ("cpu", 4, 4, 512, False),
    "cpu-ac": ("cpu", 4, 4, 512, True),
}  # one micro-batch: the tracker follows one forward
CPU_SHAPE = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=8192)  # fmt: skip


def make_group(rows: int, seq: int, vocab: int):
    """`rows` samples of exactly `seq` tokens: micro-batches as full as the configured budget allows."""
    from molt_hpc.trajectory import Group, Trajectory

    rng = random.Random(0)
    prompt = seq // 8
    samples = []
    for i in range(rows):
        toks = [rng.randrange(1, vocab) for _ in range(seq)]
        lps = [-rng.uniform(0.5, 3.0) for _ in range(seq - prompt)]
        samples.append(
            Trajectory(toks, prompt, [(prompt, seq)], lps, [0] * (seq - prompt), float(i % 2), rollout_id=f"s{i}")
        )
    return Group("g0", "p0", samples)


def config_for(samples: int, rows: int, seq: int, ac: bool, device: str):
    from molt_hpc.config import load_config

    return load_config(None, [
        f"rollout.max_total_tokens={seq}", f"engines.max_model_len={seq}", f"data.max_prompt_tokens={seq // 8}",
        f"rollout.n_samples={samples}", "actor.groups_per_step=1", f"actor.micro_batch_size={rows}",
        f"actor.activation_checkpointing={str(ac).lower()}", f"actor.device='{device}'", "model.dtype='bfloat16'",
    ])  # fmt: skip


def predict(shape: str, cfg, device: str):
    from gpu_common import qwen2_config

    from molt_hpc.plan.arch import arch_from_config
    from molt_hpc.plan.shape import shape_of
    from molt_hpc.plan.trainer import trainer_memory

    arch = arch_from_config(qwen2_config(shape))
    return trainer_memory(arch, shape_of(cfg, 1, device, arch)).peak


def measure(shape: str, cfg, group, world) -> tuple[float, float]:
    """(peak allocated, peak reserved) bytes of the second `train_step`; reserved is 0 on the CPU."""
    from gpu_common import build_model

    from molt_hpc.actor import build
    from molt_hpc.actor.packing import sequence_layout
    from molt_hpc.actor.state import Trainable
    from molt_hpc.actor.step import Models, train_step
    from molt_hpc.parallel import parallelize

    model = build_model(shape, torch.float32, world.device, seed=0).train()
    build.disable_dropout(model)
    documents, budget = sequence_layout(cfg, world, model)  # packed rows, as the trainer runs them
    parallelize(model, world.mesh, cfg.actor, compute_dtype=torch.bfloat16, documents=documents)
    opt = build.build_optimizer(model, cfg.actor, 1e-5)
    scheduler = build.build_scheduler(opt, cfg.actor, 100)
    models = Models(policy=Trainable("policy", model, opt, scheduler), pack_tokens=budget)
    train_step([group], cfg, models, world, pad_id=0)  # creates the optimizer state
    if world.device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        train_step([group], cfg, models, world, pad_id=0)
        torch.cuda.synchronize()
        out = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
    else:
        from torch.distributed._tools.mem_tracker import MemTracker

        tracker = MemTracker()
        tracker.track_external(model, opt)
        with tracker:
            train_step([group], cfg, models, world, pad_id=0)
        peak = tracker.get_tracker_snapshot("peak")
        out = next(v["Total"] for k, v in peak.items() if str(k).startswith("cpu")), 0.0
    del models, model, opt
    gc.collect()  # FSDP's hooks hold the model in reference cycles: free it before the next case
    if world.device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="+", default=None, help=f"of {', '.join(CASES)} (GPU) or {', '.join(CPU_CASES)}")
    ap.add_argument("--dry-run", action="store_true", help="small shapes on the CPU, measured by torch's tracker")
    args = ap.parse_args()
    from gpu_common import SHAPES

    SHAPES.setdefault("cpu", CPU_SHAPE)
    from molt_hpc.actor.world import init_world
    from molt_hpc.config.train import ActorConfig

    cpu = args.dry_run or not torch.cuda.is_available()
    device = "cpu" if cpu else "cuda"
    table = CPU_CASES if cpu else CASES
    world = init_world(ActorConfig(device=device))
    name = torch.cuda.get_device_name(0) if not cpu else "CPU (torch memory tracker)"
    print(f"== plan vs measured trainer peak on {name}", flush=True)
    print("| case | shape | samples (rows x tokens per micro-batch) | AC | predicted peak (phase) | measured allocated "
          "| error | reserved/allocated | s |")  # fmt: skip
    print("|---|---|---|---|---|---:|---:|---:|---:|")
    worst = 0.0
    for case in args.cases or list(table):
        shape, samples, rows, seq, ac = table[case]
        t0 = time.perf_counter()
        cfg = config_for(samples, rows, seq, ac, device)
        peak = predict(shape, cfg, device)
        try:
            allocated, reserved = measure(shape, cfg, make_group(samples, seq, SHAPES[shape]["vocab_size"]), world)
        except torch.OutOfMemoryError:  # a row that says so, and the next case still runs
            torch.cuda.empty_cache()
            print(f"| {case} | {shape} | {samples} ({rows} x {seq}) | {'on' if ac else 'off'} | "
                  f"{peak.total / 2**30:.2f} GiB ({peak.name}) | out of memory | | | |", flush=True)  # fmt: skip
            worst = float("inf")
            continue
        err = peak.total / allocated - 1
        worst = max(worst, abs(err))
        slack = f"{reserved / allocated:.3f}" if reserved else ""
        unit, div = ("GiB", 2**30) if not cpu else ("MiB", 2**20)
        cells = [case, shape, f"{samples} ({rows} x {seq})", "on" if ac else "off",
                 f"{peak.total / div:.2f} {unit} ({peak.name})", f"{allocated / div:.2f} {unit}", f"{err:+.1%}", slack,
                 f"{time.perf_counter() - t0:.0f}"]  # fmt: skip
        print("| " + " | ".join(cells) + " |", flush=True)
    print(f"worst error {worst:.1%} (target within 15%)")
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
