"""Expert parallelism on 4 or 8 GPUs: trainer step time with EP against FSDP alone, at a 128-expert top-8 shape.

The model is a Qwen3-MoE with Qwen3-30B-A3B's layer shape (hidden 2048, 128 experts of width 768,
top-8, 32 heads × 128, 4 KV heads) but few layers (4), random weights built on the GPU. Every case
trains the same tokens: `rows` sequences of `seq` tokens per GPU, cross-entropy over every position
divided by the global token count, the trainer's loss scaling (× world), `parallelize` (bf16 compute,
fp32 master weights and reduction) and the trainer's `optimizer_step` (clip, fused AdamW):

- FSDP only (`actor.ep = 1`, the baseline): every rank runs transformers' grouped_mm experts on all 128
  experts, FSDP gathering each layer's experts in full;
- EP = world (and EP = world / 2 × FSDP 2 on 8 GPUs), tokens moved by torch's all-to-all;
- the same with `actor.ep_dispatch = "deep_ep"` where `deep_ep` imports (skipped otherwise).

Reported: median step seconds over 4 timed steps after 2 warm-ups, tokens/s per GPU, the peak memory,
and the speedup over FSDP only (its seconds over the case's). A case that runs out of memory reports nan.

    torchrun --nproc-per-node 8 bench/gpu_ep.py [--layers 4] [--seq 4096] [--rows 2] [--out rows.jsonl]
    torchrun --nproc-per-node 2 bench/gpu_ep.py --dry-run      # CPU, gloo, a tiny MoE: checks the script
"""

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from gpu_common import sync, write_row

WARMUP, TIMED = 2, 4
SHAPE = dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128, intermediate_size=6144,
             moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, vocab_size=151936)  # fmt: skip
TINY = dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32, intermediate_size=128,
            moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, vocab_size=128)  # fmt: skip


def build(shape: dict, layers: int, device: torch.device):
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from molt_hpc.hf_logging import quiet_transformers

    quiet_transformers()
    config = Qwen3MoeConfig(**shape, num_hidden_layers=layers, norm_topk_prob=True, max_position_embeddings=32768,
                            tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    return model.train()


def case_time(shape, layers, world, ids, ep: int, dispatch: str, dtype) -> tuple[float, float]:
    """(median step seconds, peak GiB) of one configuration; nan on out-of-memory."""
    from molt_hpc.actor.build import build_optimizer
    from molt_hpc.actor.state import Trainable
    from molt_hpc.actor.step import optimizer_step
    from molt_hpc.config.train import ActorConfig
    from molt_hpc.parallel import parallelize

    cfg = ActorConfig(ep=ep, ep_dispatch=dispatch, device=world.device.type, lr=1e-5)
    model = opt = None
    try:
        model = build(shape, layers, world.device)
        parallelize(model, world.mesh, cfg, compute_dtype=dtype)
        opt = build_optimizer(model, cfg, cfg.lr)
        part = Trainable("policy", model, opt, None)
        count = ids.numel() * world.size

        def step():
            logits = model(input_ids=ids).logits.float()
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                   reduction="sum") / count  # fmt: skip
            (loss * world.size).backward()
            optimizer_step(part, 1.0)

        if world.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(WARMUP + TIMED):
            sync(world.device)
            dist.barrier()
            t0 = time.perf_counter()
            step()
            sync(world.device)
            times.append(time.perf_counter() - t0)
        peak = torch.cuda.max_memory_allocated() / 2**30 if world.device.type == "cuda" else 0.0
        return statistics.median(times[WARMUP:]), peak
    except torch.OutOfMemoryError:
        return float("nan"), float("nan")
    finally:
        model = opt = None  # frees the case's memory before the next one
        if world.device.type == "cuda":
            torch.cuda.empty_cache()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--rows", type=int, default=2, help="sequences per GPU per step")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--dry-run", action="store_true", help="a tiny MoE on the CPU over gloo: checks the script")
    args = ap.parse_args()
    from molt_hpc.actor.world import init_world
    from molt_hpc.config.train import ActorConfig

    dry = args.dry_run
    if not dry and torch.cuda.device_count() < 2:
        print("gpu_ep: expert parallelism needs 2+ CUDA GPUs (made for 4 or 8), under torchrun; --dry-run on a CPU")
        return 0
    world = init_world(ActorConfig(device="cpu" if dry else "cuda"))
    shape, layers = (TINY, 2) if dry else (SHAPE, args.layers)
    seq, rows = (32, 2) if dry else (args.seq, args.rows)
    dtype = torch.float32 if dry else torch.bfloat16
    torch.manual_seed(world.rank)
    ids = torch.randint(1, shape["vocab_size"], (rows, seq), device=world.device)
    cases = [(1, "all_to_all"), (world.size, "all_to_all")]
    if world.size >= 4 and world.size % 2 == 0:
        cases.append((world.size // 2, "all_to_all"))
    if not dry and importlib.util.find_spec("deep_ep") is not None:
        cases.append((world.size, "deep_ep"))
    label = f"{shape['num_experts']} experts top-{shape['num_experts_per_tok']}, {layers} layers, {rows}x{seq}/GPU"
    base = None
    for ep, dispatch in cases:
        seconds, peak = case_time(shape, layers, world, ids, ep, dispatch, dtype)
        if ep == 1:
            base = seconds
        name = "FSDP only" if ep == 1 else f"EP {ep} x FSDP {world.size // ep} ({dispatch})"
        if world.is_main:
            write_row(args.out, bench="ep", case=f"{name}, {world.size} GPUs, {label}", value=seconds, unit="s/step",
                      baseline=base, ratio=base / seconds if base and seconds == seconds else None,
                      note=f"{rows * seq / seconds:,.0f} tok/s/GPU, peak {peak:.1f} GiB")  # fmt: skip
    if not dry and importlib.util.find_spec("deep_ep") is None and world.is_main:
        print("gpu_ep: deep_ep does not import here: the DeepEP case was skipped")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
