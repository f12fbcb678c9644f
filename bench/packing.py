"""Trainer step on the CPU: packed micro-batches against padded ones, the same batch in the same run.

A long-tail length mix (lognormal, clipped to [--min-len, --max-len] tokens; a quarter prompt, the
rest one action) trains one `train_step` per repeat on a world of one, from the same weights:

- padded: `actor.packing = 'off'`, `micro_batch_size` rows per forward, cut to the longest of them;
- packed: `actor.packing = 'on'` with the default budget (`micro_batch_size × max_len` tokens a row)
  and with a smaller one (`--small-budget`: more forwards, each with less to share).

Reports real tokens per second, the ratio to padded, and the first step's loss of each (the same
batch from the same weights: the losses agree to float rounding). `actor.packing = 'auto'` on CPUs
was decided from it (`molt_hpc.actor.packing.packing_on`).

    python bench/packing.py [--hidden 128 --layers 2 --samples 64 --max-len 256]
"""

import argparse
import copy
import math
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def long_tail_groups(n: int, lo: int, hi: int, vocab: int, seed: int = 0):
    """`n` samples in groups of 4, lengths lognormal around lo·4 clipped to [lo, hi]."""
    from molt_hpc.trajectory import Group, Trajectory

    rng = random.Random(seed)
    out = []
    for g in range(n // 4):
        samples = []
        for i in range(4):
            length = int(min(hi, max(lo, rng.lognormvariate(math.log(4 * lo), 0.9))))
            prompt = max(1, length // 4)
            toks = [rng.randrange(4, vocab) for _ in range(length)]
            k = length - prompt
            samples.append(Trajectory(toks, prompt, [(prompt, length)], [-4.0] * k, [0] * k, rng.random(),
                                      group_id=f"g{g}", rollout_id=f"g{g}-{i}"))  # fmt: skip
        out.append(Group(f"g{g}", f"p{g}", samples))
    return out


def parse_args() -> argparse.Namespace:
    """The command line: the model's size, the length mix, the micro-batch and the repeats."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--min-len", type=int, default=16)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--micro", type=int, default=16)
    p.add_argument("--small-budget", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    return p.parse_args()


def case_sets(args: argparse.Namespace) -> tuple[list[str], dict[str, list[str]]]:
    """The config overrides every case shares, and each case's own by its name."""
    h = args.hidden
    base_sets = [f"model.tiny.hidden_size={h}", f"model.tiny.num_layers={args.layers}",
                 f"model.tiny.intermediate_size={2 * h}", f"model.tiny.max_position_embeddings={args.max_len}",
                 f"rollout.max_total_tokens={args.max_len}", f"engines.max_model_len={args.max_len}",
                 f"actor.micro_batch_size={args.micro}", "actor.device='cpu'", "actor.lr=1e-5"]  # fmt: skip
    cases = {
        "padded": ["actor.packing='off'"],
        f"packed, {args.micro * args.max_len} tokens a row": ["actor.packing='on'"],
        f"packed, {args.small_budget} tokens a row": ["actor.packing='on'",
                                                       f"actor.max_tokens_per_micro_batch={args.small_budget}"],
    }  # fmt: skip
    return base_sets, cases


def time_case(cfg, world, plain, data, repeats: int) -> tuple[float, float]:
    """One case from a copy of `plain`: (median seconds of `repeats` steps, the first step's loss)."""
    from molt_hpc.actor import build, state
    from molt_hpc.actor.packing import sequence_layout
    from molt_hpc.actor.step import Models, train_step
    from molt_hpc.parallel import parallelize

    model = copy.deepcopy(plain)
    docs, pack_tokens = sequence_layout(cfg, world, model)
    parallelize(model, world.mesh, cfg.actor, documents=docs)
    opt = build.build_optimizer(model, cfg.actor, cfg.actor.lr)
    models = Models(state.Trainable("policy", model, opt, build.build_scheduler(opt, cfg.actor, 10**6)),
                    pack_tokens=pack_tokens)  # fmt: skip
    loss = train_step(data, cfg, models, world, pad_id=0)["loss"]  # the first step, from the same weights
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        train_step(data, cfg, models, world, pad_id=0)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), loss


def print_table(args: argparse.Namespace, data, tokens: int, rows: list[tuple[str, float, float]]) -> None:
    """The header line and one row per case: step seconds, tokens/s, the ratio to padded, the first loss."""
    h, lengths = args.hidden, [len(s.tokens) for g in data for s in g.samples]
    print(f"packing bench: h{h} x {args.layers} layers, {args.samples} samples of {min(lengths)}-{max(lengths)} "
          f"tokens (mean {statistics.mean(lengths):.0f}), {torch.get_num_threads()} thread(s), "
          f"median of {args.repeats} steps")  # fmt: skip
    print(f"{'case':<32} {'step s':>8} {'tok/s':>8} {'vs padded':>10} {'first loss':>14}")
    padded_s = rows[0][1]
    for name, s, loss in rows:
        print(f"{name:<32} {s:>8.3f} {tokens / s:>8.0f} {padded_s / s:>9.2f}x {loss:>14.8f}")


def main() -> int:
    args = parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

    from molt_hpc.actor.world import init_world
    from molt_hpc.config import load_config
    from molt_hpc.models import build_tiny, load_causal_lm

    base_sets, cases = case_sets(args)
    work = Path(tempfile.mkdtemp(prefix="bench-packing-"))
    cfg0 = load_config(None, base_sets)
    base = build_tiny(work / "model", cfg0.model.tiny)
    world = init_world(cfg0.actor)
    data = long_tail_groups(args.samples, args.min_len, args.max_len, 100)
    tokens = sum(len(s.tokens) for g in data for s in g.samples)
    plain = load_causal_lm(base).train()
    rows = []
    for name, sets in cases.items():
        cfg = load_config(None, [*base_sets, *sets])
        seconds, loss = time_case(cfg, world, plain, data, args.repeats)
        rows.append((name, seconds, loss))
    print_table(args, data, tokens, rows)
    torch.distributed.destroy_process_group()
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
