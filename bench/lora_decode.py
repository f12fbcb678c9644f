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


class DecodeStep:
    """One decode step of `model` (one new token per row over a 128-token cache), timed again and again."""

    def __init__(self, model, batch: int, device: str) -> None:
        import inspect

        self.model, self.device = model, device
        # transformers >= 5.x renamed `past_key_values` to `cache`; take whichever this version has
        self.kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        gen = torch.Generator().manual_seed(1)
        ids = torch.randint(0, 32000, (batch, 128), generator=gen).to(device)
        self.nxt = torch.randint(0, 32000, (batch, 1), generator=gen).to(device)
        with torch.no_grad():
            out = model(input_ids=ids, use_cache=True)
        self.cache = getattr(out, self.kw, None) or out.past_key_values

    def times_ms(self, repeats: int) -> list[float]:
        times = []
        with torch.no_grad():
            for _ in range(repeats):
                if self.device == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                self.model(input_ids=self.nxt, use_cache=True, **{self.kw: self.cache})
                if self.device == "cuda":
                    torch.cuda.synchronize()
                times.append(1000 * (time.perf_counter() - t0))
                self.cache.crop(-1)  # drop the token just added: every step attends to the same 128
        return times


def main() -> None:
    from molt_hpc.config.train import LoraConfig
    from molt_hpc.models.lora import inject

    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--rounds", type=int, default=10, help="rounds of 5 steps of each form, the forms interleaved")
    args = ap.parse_args()
    print(f"arguments: {vars(args)}")
    dtype = getattr(torch, args.dtype)
    forms = {"base model (baseline)": build(args.hidden, args.layers, args.device, dtype)}
    forms["merged"] = build(args.hidden, args.layers, args.device, dtype)
    with torch.no_grad():  # merged: the same modules with the adapters' product added to their weights
        for p in forms["merged"].parameters():
            p.add_(1e-3)
    unmerged = build(args.hidden, args.layers, args.device, dtype)
    inject(unmerged, LoraConfig(rank=args.rank, alpha=2.0 * args.rank))
    forms["unmerged (peft layers)"] = unmerged.to(args.device)  # fp32 adapters, as the trainer sends them
    steps = {name: DecodeStep(model, args.batch, args.device) for name, model in forms.items()}
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(args.rounds):  # interleaved, so a slow spell of a shared machine hits every form alike
        for name, step in steps.items():
            times[name] += step.times_ms(5)
    print(
        f"decode step: hidden {args.hidden}, {args.layers} layers, batch {args.batch}, rank {args.rank}, "
        f"{args.device}, {args.dtype}; median of {5 * args.rounds}"
    )
    base = statistics.median(times["base model (baseline)"])
    for name, ms in times.items():
        print(f"  {name:24s} {statistics.median(ms):8.2f} ms  {statistics.median(ms) / base:5.2f}x")


if __name__ == "__main__":
    main()
