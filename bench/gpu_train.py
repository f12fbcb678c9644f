"""Trainer RL step on two GPUs against the plain FSDP2 reference step, Qwen2 0.5B / 1.5B / 7B shapes, seq 4096.

Every case trains on the same tokens: one group of samples of exactly 4096 tokens (512 prompt + 3584
response), one sample per row, `mb` rows per GPU (4; 2 at 7B, 1 when a single GPU holds all of 7B's
state), one optimizer update per step. A case that runs out of GPU memory is reported as nan.

- reference: the plain FSDP2 step written here — `fully_shard` per decoder block and the root (bf16
  params, fp32 reduce), HF forward, full-vocabulary cross-entropy on every position, backward, fused
  AdamW;
- reference loop + PPO loss: the same loop with the trainer's loss (`policy_logprobs` over action
  tokens, `policy_loss`) in place of the cross-entropy, to separate the loss from the framework;
- trainer: `molt_hpc.actor.step.train_step` on a model built the trainer's way (`parallelize`,
  `build_optimizer`, LR schedule): experience, advantages, global loss scale, PPO loss, clip, step.

MFU counts 6·N + 12·L·H·T FLOPs per token against 989 TFLOP/s per GPU; 2 warm-up + 4 timed steps,
median. A last section times the loss alone on one GPU (0.5B vocabulary): cross-entropy against the
trainer's chunked log-probs, from logits and from hidden states (`bench/gpu_loss.py`).

    torchrun --nproc-per-node 2 bench/gpu_train.py [--shapes 0.5b 1.5b 7b] [--out rows.jsonl] [--dry-run]
"""

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from gpu_common import (
    PEAK_BF16,
    build_model,
    flops_per_token,
    free,
    param_count,
    peak_gib,
    qwen2_config,
    sync,
    timed_ms,
    write_row,
)
from gpu_loss import loss_kernels
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from molt_hpc.trajectory import Group, Trajectory

MICRO = {"0.5b": 4, "1.5b": 4, "7b": 2, "tiny": 2}
WARMUP, TIMED = 2, 4


def make_group(samples: int, seq: int, prompt: int, vocab: int) -> Group:
    rng = random.Random(0)
    out = []
    for i in range(samples):
        toks = [rng.randrange(1, vocab) for _ in range(seq)]
        n = seq - prompt
        lps = [-rng.uniform(0.5, 3.0) for _ in range(n)]
        out.append(Trajectory(toks, prompt, [(prompt, seq)], lps, [0] * n, rng.random(), rollout_id=f"s{i}"))
    return Group("g0", "p0", out)


def step_times(step, world) -> float:
    """Median seconds of `TIMED` steps after `WARMUP`, every rank in step."""
    times = []
    for i in range(WARMUP + TIMED):
        sync(world.device)
        dist.barrier()
        t0 = time.perf_counter()
        step()
        sync(world.device)
        dist.barrier()
        if i >= WARMUP:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def reference_model(shape: str, world):
    model = build_model(shape, torch.float32, world.device, seed=0).train()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.model.layers:
        fully_shard(block, mesh=world.mesh, mp_policy=mp)
    fully_shard(model, mesh=world.mesh, mp_policy=mp)
    fused = world.device.type == "cuda"
    return model, torch.optim.AdamW(model.parameters(), lr=1e-5, fused=fused or None)


def reference_step(model, opt, mb) -> None:
    logits = model(input_ids=mb.sequences, position_ids=mb.position_ids).logits
    vocab = logits.shape[-1]
    loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, vocab), mb.sequences[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def ppo_loss_step(model, opt, mb, exp, cfg, count, world) -> None:
    from molt_hpc.actor.batch import policy_logprobs
    from molt_hpc.algorithm import policy_loss

    logp, ent = policy_logprobs(model, mb, cfg.rollout.temperature, cfg.actor.logprob_chunk)
    loss, _ = policy_loss(logp, mb.action_log_probs, mb.advantages, mb.action_mask, cfg.algorithm, count,
                          seq_index=mb.seq_index, n_samples=exp.num_samples, entropy=ent)  # fmt: skip
    (loss * world.size).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def run_reference(shape: str, world, mb, exp, cfg, count) -> dict[str, tuple[float, float]]:
    """The plain step and the plain loop with the PPO loss: (seconds per step, peak GiB) each."""
    model, opt = reference_model(shape, world)
    free()
    out = {"reference FSDP2 step (CE)": guarded(lambda: step_times(lambda: reference_step(model, opt, mb), world))}
    free()
    out["reference loop + PPO loss"] = guarded(
        lambda: step_times(lambda: ppo_loss_step(model, opt, mb, exp, cfg, count, world), world)
    )
    return out


def guarded(fn) -> tuple[float, float]:
    """(fn(), peak GiB), or (nan, peak) when the case does not fit in GPU memory."""
    try:
        return fn(), peak_gib()
    except torch.OutOfMemoryError:  # reported as a row, and the next case still runs
        free()
        return float("nan"), peak_gib()


PHASES = {
    "experience: groups -> tensors, advantages": ("step", "build_experience"),
    "micro-batch cut + global loss scale": ("step", "rank_micro_batches", "global_loss_scale"),
    "forward: model + chunked log-probs": ("step", "policy_logprobs"),
    "policy loss": ("step", "policy_loss"),
    "gradient clip (local shards)": ("step", "clip_grad_norm"),
    "metrics: reduce + batch metrics": ("step", "batch_metrics"),
}


def phase_times(world, group: Group, cfg, models) -> tuple[dict[str, float], float]:
    """Milliseconds of each phase of one `train_step` (after one that warms up), the device synchronised
    around each, and of the whole step."""
    from molt_hpc.actor import step
    from molt_hpc.actor.step import Meter, train_step

    spent: dict[str, float] = {}
    saved = []

    def wrap(owner, attr: str, phase: str):
        fn = getattr(owner, attr)
        saved.append((owner, attr, fn))

        def timed_fn(*a, **k):
            sync(world.device)
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                sync(world.device)
                spent[phase] = spent.get(phase, 0.0) + 1000 * (time.perf_counter() - t0)

        setattr(owner, attr, timed_fn)

    for phase, (_, *names) in PHASES.items():
        for name in names:
            wrap(step, name, phase)
    wrap(Meter, "reduce", "metrics: reduce + batch metrics")
    opt = models.policy.optimizer
    wrap(opt, "step", "optimizer step (fused AdamW)")
    try:
        for _ in range(2):  # the first warms up
            spent.clear()
            total = timed_ms(lambda: train_step([group], cfg, models, world, pad_id=0), world.device)
    finally:
        for owner, attr, fn in reversed(saved):
            if owner is opt:
                del opt.step  # back to the class's method
            else:
                setattr(owner, attr, fn)
    return spent, total


def write_phase_rows(shape: str, spent: dict[str, float], total: float, out: Path | None) -> None:
    """One row per phase against the whole step, and one for what is left between them."""
    for phase, ms in spent.items():
        write_row(
            out,
            bench="host",
            case=f"{shape} trainer step, {phase}",
            value=ms,
            unit="ms",
            baseline=total,
            ratio=ms / total,
            note="baseline: the whole step, device synced per phase",
        )
    rest = total - sum(spent.values())
    write_row(out, bench="host", case=f"{shape} trainer step, the rest: backward + Python between phases",
              value=rest, unit="ms", baseline=total, ratio=rest / total)  # fmt: skip


def clip_against_torch(shape: str, world, models, out: Path | None) -> None:
    """The gradient clip alone, on gradients of one more backward: torch's DTensor path against the local shards."""
    from molt_hpc.actor import clip

    part = models.policy
    params = [p for p in part.model.parameters() if p.requires_grad]
    part.model(input_ids=torch.ones(1, 8, dtype=torch.long, device=world.device)).logits.float().mean().backward()
    ours = statistics.median(timed_ms(lambda: clip.clip_grad_norm(params, 1e9), world.device) for _ in range(5))
    theirs = statistics.median(
        timed_ms(lambda: torch.nn.utils.clip_grad_norm_(params, 1e9), world.device) for _ in range(5)
    )
    part.optimizer.zero_grad(set_to_none=True)
    if world.is_main:
        write_row(out, bench="host", case=f"{shape} gradient clip, {len(params)} sharded tensors: local shards",
                  value=ours, unit="ms", baseline=theirs, ratio=ours / theirs,
                  note="baseline: torch.nn.utils.clip_grad_norm_ on the same DTensor gradients")  # fmt: skip


def host_breakdown(shape: str, world, group: Group, cfg, models, out: Path | None) -> None:
    """One `train_step` with the device synchronised around each phase: each phase's own milliseconds
    (what is left is backward, the optimizer and the Python between them); then the gradient clip of the
    same gradients by torch's `clip_grad_norm_` against ours."""
    spent, total = phase_times(world, group, cfg, models)
    if world.is_main:
        write_phase_rows(shape, spent, total, out)
    clip_against_torch(shape, world, models, out)


def run_trainer(shape: str, world, group: Group, cfg, profile: bool, out: Path | None = None) -> tuple[float, float]:
    """`train_step` on a model built the trainer's way (random weights instead of a checkpoint); with
    `profile`, one more step under the torch profiler, its table printed."""
    from molt_hpc.actor import build
    from molt_hpc.actor.state import Trainable
    from molt_hpc.actor.step import Models, train_step
    from molt_hpc.parallel import parallelize

    model = build_model(shape, torch.float32, world.device, seed=0).train()
    build.disable_dropout(model)
    parallelize(model, world.mesh, cfg.actor, compute_dtype=torch.bfloat16)
    opt = build.build_optimizer(model, cfg.actor, cfg.actor.lr)
    models = Models(policy=Trainable("policy", model, opt, build.build_scheduler(opt, cfg.actor, 10**6)))
    free()
    result = guarded(lambda: step_times(lambda: train_step([group], cfg, models, world, pad_id=0), world))
    host_breakdown(shape, world, group, cfg, models, out)
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as profiler

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if world.device.type == "cuda" else [])
        with profiler(activities=acts) as prof:
            train_step([group], cfg, models, world, pad_id=0)
            sync(world.device)
        if world.is_main:
            key = "cuda_time_total" if world.device.type == "cuda" else "cpu_time_total"
            print(prof.key_averages().table(sort_by=key, row_limit=30), flush=True)
    return result


def bench_shape(
    shape: str,
    seq: int,
    prompt: int,
    world,
    out: Path | None,
    profile: bool = False,
    kernels: tuple[str, ...] = ("auto",),
) -> None:
    from transformers import AutoModelForCausalLM

    from molt_hpc.actor.batch import my_rows
    from molt_hpc.algorithm import compute_advantages, experience_from_groups
    from molt_hpc.algorithm.loss import global_loss_scale
    from molt_hpc.config import load_config

    mb_rows = MICRO[shape] if world.size > 1 or shape != "7b" else 1  # one GPU holds all 122 GB of 7B state
    sets = [f"rollout.max_total_tokens={seq}", f"data.max_prompt_tokens={prompt}", f"engines.max_model_len={seq}",
            f"actor.micro_batch_size={mb_rows}",
            f"actor.device='{world.device.type}'", "model.dtype='bfloat16'", "actor.lr=1e-5"]  # fmt: skip
    cfg = load_config(None, sets)
    with torch.device("meta"):
        params = param_count(AutoModelForCausalLM.from_config(qwen2_config(shape)))
    vocab = qwen2_config(shape).vocab_size
    group = make_group(world.size * mb_rows, seq, prompt, vocab)
    exp = compute_advantages(experience_from_groups([group], max_len=seq, pad_id=0), cfg.algorithm)
    mb = exp.rows(my_rows(torch.arange(exp.sequences.shape[0]), world)).to(world.device)
    if world.is_main and profile:  # the step's CPU-side batch assembly, on its own
        cpu_s = statistics.median(
            timed_ms(lambda: compute_advantages(experience_from_groups([group], max_len=seq), cfg.algorithm), "cpu")
            for _ in range(5)
        )
        write_row(out, bench="train", case=f"trainer step's CPU work: experience + advantages ({len(group.samples)} x "
                  f"{seq} tokens)", value=cpu_s, unit="ms")  # fmt: skip
    scale = global_loss_scale([mb.action_mask], [mb.seq_index], cfg.rollout.max_new_tokens)
    results = run_reference(shape, world, mb, exp, cfg, scale)
    free()
    for kernel in kernels:  # the trainer's step with each log-prob kernel (`actor.logprob_kernel`)
        kcfg = cfg.model_copy(update={"actor": cfg.actor.model_copy(update={"logprob_kernel": kernel})})
        name = f"trainer train_step (molt_hpc.actor), logprob_kernel {kernel}"
        results[name] = run_trainer(shape, world, group, kcfg, profile and kernel == kernels[0], out)
        free()
    tokens = world.size * mb_rows * seq
    flops = flops_per_token(shape, params, seq) * tokens
    base = results["reference FSDP2 step (CE)"][0]
    for name, (t, mem) in results.items():
        if world.is_main:
            note = f"{1000 * t:.0f} ms/step, {tokens / t / world.size:.0f} tok/s/GPU, peak {mem:.1f} GiB"
            write_row(out, bench="train", case=f"{shape} ({params / 1e9:.2f}B), {name}",
                      value=100 * flops / (t * world.size * PEAK_BF16), unit="% MFU",
                      baseline=100 * flops / (base * world.size * PEAK_BF16), ratio=base / t,
                      target=">= 1.0x" if name.startswith("trainer") else None, note=note)  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["0.5b", "1.5b", "7b"])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--kernels", nargs="+", default=["auto"], help="time the trainer step with each log-prob kernel")
    ap.add_argument("--dry-run", action="store_true", help="tiny shape on the CPU over gloo: checks the script")
    args = ap.parse_args()
    from molt_hpc.actor.world import init_world
    from molt_hpc.config.train import ActorConfig

    dry = args.dry_run
    if not dry and torch.cuda.device_count() < 1:
        print("gpu_train: needs CUDA GPUs, under torchrun --nproc-per-node 2 (or 1); --dry-run on a CPU")
        return 0
    world = init_world(ActorConfig(device="cpu" if dry else "cuda"))
    seq, prompt = (64, 8) if dry else (4096, 512)
    for i, shape in enumerate(["tiny"] if dry else args.shapes):
        bench_shape(
            shape,
            seq,
            prompt,
            world,
            args.out,
            profile=i == 0,
            kernels=tuple(k for k in args.kernels if not dry or k in ("auto", "torch")),
        )
    if world.is_main:
        v, h = (1000, 128) if dry else (151936, 896)
        loss_kernels(seq, prompt, MICRO["tiny" if dry else "0.5b"], world.device, args.out, v, h)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
