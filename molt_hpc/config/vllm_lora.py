"""The config rules of LoRA runs served by vLLM: the rank vLLM is started with, and what it refuses.

vLLM serves an adapter of rank r only when r ≤ its `--max-lora-rank`, which takes one of a fixed set of
values and sizes its LoRA buffers (memory and kernels grow with it). Unset in `engines.extra_args`, the
smallest allowed value that holds `actor.lora.rank` is passed; set there, it is the limit checked here.
"""

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM 0.26 accepts for `--max-lora-rank` (its `MaxLoRARanks`)."""
MAX_LORA_RANK_FLAG = "--max-lora-rank"


def configured_max_rank(extra_args: list[str]) -> int | None:
    """`--max-lora-rank` as given in `engines.extra_args` (`--max-lora-rank 64` or `--max-lora-rank=64`), or None."""
    for i, arg in enumerate(extra_args):
        name, _, value = arg.partition("=")
        if name != MAX_LORA_RANK_FLAG:
            continue
        value = value or (extra_args[i + 1] if i + 1 < len(extra_args) else "")
        try:
            return int(value)
        except ValueError:
            raise ValueError(f"engines.extra_args: {MAX_LORA_RANK_FLAG} takes a whole number, got {value!r}") from None
    return None


def vllm_max_lora_rank(cfg) -> int:
    """The `--max-lora-rank` vLLM runs with for `cfg` (a `MoltConfig` with `[actor.lora]`)."""
    given = configured_max_rank(cfg.engines.extra_args)
    if given is not None:
        return given
    rank = cfg.actor.lora.rank
    return next((r for r in VLLM_LORA_RANKS if r >= rank), VLLM_LORA_RANKS[-1])


def vllm_lora_problem(cfg) -> str | None:
    """Why vLLM cannot serve `cfg`'s adapters, with the fix; None when it can."""
    if cfg.actor.lora.engine_weights == "merged":
        return (
            "actor.lora.engine_weights = 'merged': vLLM engines compute the adapters separately, in their own "
            "LoRA kernels; unset it (or set 'separate'), or use engines.kind = 'builtin'"
        )
    rank, limit = cfg.actor.lora.rank, vllm_max_lora_rank(cfg)
    if limit not in VLLM_LORA_RANKS:
        return f"engines.extra_args: vLLM takes {MAX_LORA_RANK_FLAG} in {list(VLLM_LORA_RANKS)}, not {limit}"
    if rank > limit:
        fix = (
            f"lower actor.lora.rank to {limit} or raise {MAX_LORA_RANK_FLAG} in engines.extra_args"
            if rank <= VLLM_LORA_RANKS[-1]
            else f"lower actor.lora.rank to at most {VLLM_LORA_RANKS[-1]}, or use engines.kind = 'builtin' "
            "(no rank limit)"
        )
        return f"actor.lora.rank = {rank} is above vLLM's LoRA rank limit ({MAX_LORA_RANK_FLAG} {limit}): {fix}"
    return None
