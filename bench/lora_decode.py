"""Decode-step time of a LoRA policy in the builtin engine's two possible forms, on one model and input.

`merged`: the adapters merged into the weights at refit (what `molt_hpc.engine.lora` does): the base
model's own kernels on other values. `unmerged`: peft's LoRA layers left in the model: each adapted
linear layer adds `x·Aᵀ·Bᵀ` (two small matmuls and an add). The base model's step is the same-run
baseline.

    python bench/lora_decode.py [--hidden 1024] [--layers 8] [--batch 16] [--rank 64] [--device cpu]
                                [--dtype float32|bfloat16]
"""

import argparse
import statistics
import time

import torch


def build(hidden: int, layers: int, device: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(
        vocab_size=32000, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
        num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 256), head_dim=64,
    )  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=dtype).to(device).eval()


def step_ms(model, batch: int, device: str, repeats: int = 20) -> float:
    """Median time of one decode step (one new token per row over a 128-token cache)."""
    ids = torch.randint(0, 32000, (batch, 128), device=device)
    nxt = torch.randint(0, 32000, (batch, 1), device=device)
    times = []
    with torch.no_grad():
        cache = model(input_ids=ids, use_cache=True).past_key_values
        for _ in range(repeats):
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            model(input_ids=nxt, past_key_values=cache, use_cache=True)
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(1000 * (time.perf_counter() - t0))
            cache.crop(-1)  # drop the token just added: every step attends to the same 128
    return statistics.median(times)


def main() -> None:
    from molt_hpc.actor import lora
    from molt_hpc.config.train import LoraConfig

    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args()
    print(f"arguments: {vars(args)}")
    model = build(args.hidden, args.layers, args.device, getattr(torch, args.dtype))
    base = step_ms(model, args.batch, args.device)
    with torch.no_grad():  # merged: the same modules with the adapters' product added to their weights
        for p in model.parameters():
            p.add_(1e-3)
    merged = step_ms(model, args.batch, args.device)
    lora.inject(model, LoraConfig(rank=args.rank, alpha=2.0 * args.rank))
    model.to(args.device)  # the adapters in fp32, as the trainer sends them; their input is cast by peft
    unmerged = step_ms(model, args.batch, args.device)
    print(
        f"decode step: hidden {args.hidden}, {args.layers} layers, batch {args.batch}, rank {args.rank}, {args.device}"
    )
    for name, ms in (("base model (baseline)", base), ("merged", merged), ("unmerged (peft layers)", unmerged)):
        print(f"  {name:24s} {ms:8.2f} ms  {ms / base:5.2f}x")


if __name__ == "__main__":
    main()
