"""The trainer's step and checkpoint, each against a plain single-process baseline in the same run.

- step: `molt_hpc.actor.step.train_step` (FSDP2 over a world of one, experience assembly, global
  token count, metrics) vs a bare loop over the same micro-batches: HF forward, the same log-probs
  and policy loss, backward, clip, AdamW;
- checkpoint: `molt_hpc.actor.state.save` (HF shards gathered bucket by bucket, DCP optimizer, run
  state, sha256 manifest, atomic publish) vs `save_pretrained` + `torch.save(optimizer.state_dict())`.

    python bench/actor.py                       # a 4-layer h256 model, 64 samples of 64 tokens
    python bench/actor.py --hidden 512 --layers 8 --samples 128
"""

import argparse
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def groups(n_groups: int, size: int, prompt: int, response: int, vocab: int):
    from molt_hpc.trajectory import Group, Trajectory

    rng = random.Random(0)
    out = []
    for g in range(n_groups):
        samples = []
        for _ in range(size):
            n = rng.randint(response // 2, response)
            toks = [rng.randrange(4, vocab) for _ in range(prompt + n)]
            samples.append(Trajectory(toks, prompt, [(prompt, prompt + n)], [-4.6] * n, [0] * n, rng.random()))
        out.append(Group(f"g{g}", f"p{g}", samples))
    return out


def baseline_step(model, opt, exp, cfg):
    from molt_hpc.algorithm import policy_loss
    from molt_hpc.algorithm.loss import LossScale

    samples = len(torch.unique(exp.seq_index[exp.action_mask]))
    count = LossScale(exp.num_action_tokens, samples, cfg.rollout.max_new_tokens)
    for mb in exp.split(cfg.actor.micro_batch_size):
        logits = model(input_ids=mb.sequences, position_ids=mb.position_ids).logits
        from molt_hpc.algorithm import token_logprobs

        logp, ent = token_logprobs(logits, mb.sequences, mask=mb.action_mask)
        loss, _ = policy_loss(logp, mb.action_log_probs, mb.advantages, mb.action_mask, cfg.algorithm, count,
                              seq_index=mb.seq_index, n_samples=exp.num_samples, entropy=ent)  # fmt: skip
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.actor.grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

    from molt_hpc.actor import build, state
    from molt_hpc.actor.step import Models, train_step
    from molt_hpc.actor.world import init_world
    from molt_hpc.algorithm import compute_advantages, experience_from_groups
    from molt_hpc.config import load_config
    from molt_hpc.models import build_tiny, load_causal_lm

    tiny = [f"model.tiny.hidden_size={args.hidden}", f"model.tiny.num_layers={args.layers}",
            f"model.tiny.intermediate_size={2 * args.hidden}"]  # fmt: skip
    cfg = load_config(None, [*tiny, "rollout.n_samples=8", f"actor.groups_per_step={args.samples // 8}"])
    work = Path(tempfile.mkdtemp(prefix="bench-actor-"))
    base = build_tiny(work / "model", cfg.model.tiny)
    world = init_world(cfg.actor)
    data = groups(args.samples // 8, 8, 16, 48, 100)

    model = build.load_model(base, cfg, world, "policy")
    opt = build.build_optimizer(model, cfg.actor, 1e-4)
    part = state.Trainable("policy", model, opt, build.build_scheduler(opt, cfg.actor, 10**6))
    models = Models(policy=part)
    plain = load_causal_lm(base).train()
    plain_opt = build.build_optimizer(plain, cfg.actor, 1e-4)
    exp = compute_advantages(experience_from_groups(data, max_len=128), cfg.algorithm)

    rows = []
    ours = timed(lambda: train_step(data, cfg, models, world, pad_id=0), args.repeats)
    base_s = timed(lambda: baseline_step(plain, plain_opt, exp, cfg), args.repeats)
    tokens = exp.attention_mask.sum().item()
    rows.append(("train step", ours, base_s, f"{tokens / ours:.0f} tok/s"))

    n = iter(range(1, 10**6))
    ck_s = timed(lambda: state.save(world, work / "ckpt", next(n), [part], {}, tokenizer_src=base,
                                    shard_bytes=64 << 20, keep_last=1), args.repeats)  # fmt: skip

    def plain_save():
        out = work / "plain"
        plain.save_pretrained(out, safe_serialization=True)
        torch.save(plain_opt.state_dict(), out / "optimizer.pt")

    plain_s = timed(plain_save, args.repeats)
    params = sum(p.numel() for p in plain.parameters())
    rows.append(("checkpoint", ck_s, plain_s, f"{params * 12 / 1e6 / ck_s:.0f} MB/s"))

    print(f"actor bench: {params / 1e6:.1f}M params, {args.samples} samples, world of {world.size}, "
          f"{torch.get_num_threads()} thread(s), median of {args.repeats}")  # fmt: skip
    print(f"{'what':<12} {'molt-hpc s':>11} {'baseline s':>11} {'ratio':>7}  throughput")
    for what, a, b, extra in rows:
        print(f"{what:<12} {a:>11.3f} {b:>11.3f} {a / b:>7.2f}  {extra}")
    torch.distributed.destroy_process_group()
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
