"""Shared pieces of the GPU benchmarks (`bench/gpu_*.py`): model shapes, random models, result rows.

Models are Qwen2-architecture shapes with random weights built on the device with `from_config`
(nothing is downloaded). Each benchmark appends its rows as JSON lines to `--out`; `bench/gpu.py`
prints them as one table. `--dry-run` runs a benchmark on the CPU with a tiny shape, to check the
script, not to measure.
"""

import gc
import json
import os
import time
from pathlib import Path
from typing import Any

import torch

PEAK_BF16 = 989e12
"""Dense bf16 peak of an H100/H200 SXM (datasheet): the MFU denominator."""
SHAPES: dict[str, dict[str, int]] = {
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936),
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, vocab_size=152064),
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1000),
}  # fmt: skip


def qwen2_config(shape: str, *, tied: bool = False):
    """The Qwen2 config of `shape` (untied LM head unless `tied`, as Qwen2-0.5B ships)."""
    from transformers import Qwen2Config

    return Qwen2Config(
        **SHAPES[shape],
        tie_word_embeddings=tied,
        max_position_embeddings=32768,
        rope_theta=1e6,
        use_sliding_window=False,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
    )


def build_model(shape: str, dtype: torch.dtype, device: str | torch.device, seed: int, *, tied: bool = False):
    """A random-init Qwen2 causal LM of `shape`, created directly on `device` (dropout off, eval mode)."""
    from transformers import AutoModelForCausalLM

    from molt_hpc.hf_logging import quiet_transformers

    quiet_transformers()
    torch.manual_seed(seed)
    with torch.device(device):
        config = qwen2_config(shape, tied=tied)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def param_count(model: torch.nn.Module) -> int:
    """Distinct parameters (tied weights once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def flops_per_token(shape: str, params: int, seq: int) -> float:
    """Training FLOPs per token, 6·N + 12·L·H·T (dense matmuls, attention without the causal halving)."""
    s = SHAPES[shape]
    return 6 * params + 12 * s["num_hidden_layers"] * s["hidden_size"] * seq


def sync(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device | str) -> float:
    """Seconds of `fn()`, the device synchronised before and after."""
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def free() -> None:
    """Collect garbage and release cached GPU memory; reset the peak so the next case measures its own."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0


def timed_ms(fn, device: torch.device | str) -> float:
    """Milliseconds of `fn()`, the device synchronised before and after."""
    return 1000 * timed(fn, device)


def hbm_bandwidth(device: torch.device | str, gib: int = 2) -> float:
    """Bytes/s of a device-to-device copy, counting bytes read plus written (the decode-step floor's rate)."""
    a = torch.empty(gib << 30, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    best = min(timed(lambda: b.copy_(a), device) for _ in range(5))
    return 2 * a.numel() / best


def write_row(out: Path | None, **row: Any) -> None:
    """One result row: bench, case, value, unit, and where it has one: baseline, ratio, target, note."""
    line = json.dumps(row)
    print(line, flush=True)
    if out is not None:
        with open(out, "a") as f:
            f.write(line + "\n")


def gpu_env() -> dict[str, str]:
    """The environment for child processes: NVLink multicast stays off (a shared host's safety rule)."""
    return {**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


def bench_device(name: str, dry: bool) -> torch.device | None:
    """GPU 0, the CPU for a `--dry-run` (tiny shapes: checks the script), or None (said why) without a GPU."""
    if not dry and not torch.cuda.is_available():
        print(f"{name}: needs a CUDA GPU; --dry-run on a CPU")
        return None
    return torch.device("cpu" if dry else "cuda:0")
