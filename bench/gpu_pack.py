"""Sequence packing on one GPU: the trainer's step on packed rows against padded rows, and its peak
memory at 32k tokens with and without activation checkpointing (Qwen2 0.5B shape, bf16 compute).

- throughput: one batch of a long-tail length mix (lognormal, median 1024, clipped to 256–8192
  tokens; a quarter prompt, the rest one action; groups of 4) trained by `train_step` from the same
  weights with `actor.packing = 'off'` (4 rows per forward, each micro-batch cut to its longest row)
  and `'on'` (rows of 4 × 8192 tokens; torch's varlen flash kernel for `sdpa`). Real tokens per second,
  median of 2 steps after one whose loss is compared: the same batch from the same weights gives the
  same loss up to bf16 rounding. Target: packed ≥ 1.5× padded.
- memory: a group of 2 samples of 32,768 tokens, one per micro-batch, `torch.cuda.max_memory_allocated`
  over a step, with and without `actor.activation_checkpointing`; next to it the planner's
  prediction (`molt_hpc.plan`) where this checkout has the planner.

    python bench/gpu_pack.py [--out rows.jsonl] [--dry-run]
"""

import argparse
import copy
import math
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from gpu_common import build_model, qwen2_config, sync, write_row

from molt_hpc.trajectory import Group, Trajectory

FULL = {"shape": "0.5b", "lo": 256, "hi": 8192, "median": 1024, "samples": 48, "rows": 4, "long": 32768}
DRY = {"shape": "tiny", "lo": 16, "hi": 256, "median": 64, "samples": 16, "rows": 4, "long": 512}


def long_tail(n: int, lo: int, hi: int, median: int, vocab: int, seed: int = 0) -> list[Group]:
    rng = random.Random(seed)
    out = []
    for g in range(n // 4):
        samples = []
        for i in range(4):
            length = int(min(hi, max(lo, rng.lognormvariate(math.log(median), 1.0))))
            samples.append(_sample(rng, length, max(1, length // 4), vocab, f"g{g}", i))
        out.append(Group(f"g{g}", f"p{g}", samples))
    return out


def _sample(rng: random.Random, length: int, prompt: int, vocab: int, group: str, i: int) -> Trajectory:
    toks = [rng.randrange(1, vocab) for _ in range(length)]
    k = length - prompt
    lps = [-rng.uniform(0.5, 3.0) for _ in range(k)]
    return Trajectory(toks, prompt, [(prompt, length)], lps, [0] * k, rng.random(), group_id=group,
                      rollout_id=f"{group}-{i}")  # fmt: skip


def config(p: dict, max_len: int, sets: list[str], device: str):
    from molt_hpc.config import load_config

    base = [f"rollout.max_total_tokens={max_len}", f"engines.max_model_len={max_len}", "data.max_prompt_tokens=64",
            f"actor.micro_batch_size={p['rows']}", f"actor.device='{device}'", "model.dtype='bfloat16'",
            "actor.lr=1e-6", "rollout.n_samples=4"]  # fmt: skip
    return load_config(None, [*base, *sets])


def trainer(plain, cfg, world):
    """`plain`'s copy set up the trainer's way: packing decision, `parallelize`, AdamW, schedule."""
    from molt_hpc.actor import build
    from molt_hpc.actor.packing import sequence_layout
    from molt_hpc.actor.state import Trainable
    from molt_hpc.actor.step import Models
    from molt_hpc.parallel import parallelize

    model = copy.deepcopy(plain).train()
    docs, pack_tokens = sequence_layout(cfg, world, model)
    parallelize(model, world.mesh, cfg.actor, compute_dtype=torch.bfloat16, documents=docs)
    opt = build.build_optimizer(model, cfg.actor, cfg.actor.lr)
    kernel = model.molt_attention.kernel if docs is not None else "sdpa (the model's own)"
    return Models(Trainable("policy", model, opt, build.build_scheduler(opt, cfg.actor, 10**6)),
                  pack_tokens=pack_tokens), kernel  # fmt: skip


def free() -> None:
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def throughput(p: dict, plain, world, out: Path | None) -> None:
    from molt_hpc.actor.step import train_step

    vocab = qwen2_config(p["shape"]).vocab_size
    data = long_tail(p["samples"], p["lo"], p["hi"], p["median"], vocab)
    tokens = sum(len(s.tokens) for g in data for s in g.samples)
    results = {}
    for name, sets in {"padded": ["actor.packing='off'"], "packed": ["actor.packing='on'"]}.items():
        cfg = config(p, p["hi"], sets, world.device.type)
        models, kernel = trainer(plain, cfg, world)
        free()
        loss = train_step(data, cfg, models, world, pad_id=0)["loss"]
        times = []
        for _ in range(2):
            sync(world.device)
            t0 = time.perf_counter()
            train_step(data, cfg, models, world, pad_id=0)
            sync(world.device)
            times.append(time.perf_counter() - t0)
        results[name] = (tokens / statistics.median(times), loss, kernel)
        del models
        free()
    (pad_tps, pad_loss, _), (pack_tps, pack_loss, kernel) = results["padded"], results["packed"]
    mix = f"{p['shape']}, {len(data) * 4} samples {p['lo']}-{p['hi']} tokens (lognormal, {tokens} tokens)"
    write_row(out, bench="pack", case=f"{mix}: packed ({kernel}) vs padded ({p['rows']} rows a forward)",
              value=pack_tps, unit="tok/s", baseline=pad_tps, ratio=pack_tps / pad_tps, target=">= 1.5x",
              note=f"budget {p['rows']}x{p['hi']} tokens a row")  # fmt: skip
    write_row(out, bench="pack", case=f"{mix}: first-step loss, packed vs padded", value=pack_loss, unit="loss",
              baseline=pad_loss, ratio=pack_loss / pad_loss if pad_loss else None, target="1.00x (bf16 rounding)",
              note=f"|diff| {abs(pack_loss - pad_loss):.2e}")  # fmt: skip


def planner_peak_gib(cfg, shape: str) -> tuple[float | None, str]:
    """(the planner's predicted trainer peak on one GPU, a note): where this checkout has `molt_hpc.plan`."""
    try:
        from molt_hpc.plan import plan_config
    except ImportError:
        return None, "planner: not in this checkout"
    with tempfile.TemporaryDirectory() as d:
        qwen2_config(shape).save_pretrained(d)
        cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": d})})
        try:
            plan, _ = plan_config(cfg, local=True, gpus=1)
            return plan.trainer.peak.total / 2**30, "baseline: the planner's prediction"
        except (AttributeError, ValueError, OSError) as err:  # the row still reports the measurement
            return None, f"planner failed: {err}"


def memory(p: dict, plain, world, out: Path | None) -> None:
    from molt_hpc.actor.step import train_step

    n = p["long"]
    rng = random.Random(1)
    vocab = qwen2_config(p["shape"]).vocab_size
    group = Group("long", "long", [_sample(rng, n, 64, vocab, "long", i) for i in range(2)])
    for ac in (False, True):
        cfg = config(p, n, ["actor.packing='on'", "actor.micro_batch_size=1",
                            f"actor.activation_checkpointing={str(ac).lower()}"], world.device.type)  # fmt: skip
        models, _ = trainer(plain, cfg, world)
        free()
        try:
            train_step([group], cfg, models, world, pad_id=0)
            peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")
        except torch.OutOfMemoryError:
            peak = float("nan")
        predicted, note = planner_peak_gib(cfg, p["shape"])
        write_row(out, bench="pack", case=f"{p['shape']} peak memory, micro-batches of {n} tokens, "
                  f"activation checkpointing {'on' if ac else 'off'}", value=peak, unit="GiB",
                  baseline=predicted, ratio=peak / predicted if predicted else None, note=note)  # fmt: skip
        del models
        free()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--dry-run", action="store_true", help="tiny shape on the CPU: checks the script")
    args = ap.parse_args()
    from molt_hpc.actor.world import init_world
    from molt_hpc.config.train import ActorConfig

    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_pack: needs a CUDA GPU; --dry-run checks the script on a CPU")
        return 0
    p = DRY if args.dry_run else FULL
    world = init_world(ActorConfig(device="cpu" if args.dry_run else "cuda"))
    plain = build_model(p["shape"], torch.float32, world.device, seed=0)
    throughput(p, plain, world, args.out)
    memory(p, plain, world, args.out)
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
