"""Sampling: the generate request's checks against the model (schema: `requests.py`), and the per-token processing.

`processed_logprobs` is the one definition of the distribution a token is drawn from: logits /
temperature, then top-k, then top-p, then min-p, then log-softmax. The engine samples from it and
returns the sampled token's entry, so the trainer recomputing the same function over a
teacher-forced forward gets the same log-prob (what the importance ratio needs). Temperature 0 is
greedy decoding; its log-probs are those of temperature 1 with the same filters.

A draw takes 32 random bits per row (`inverse_cdf`): a seeded request's come from its seed and the token's
index (`seeded_bits`), so it samples the same tokens whatever batch it shares and on any device, and the
engine draws a whole batch, seeded rows and others, in one pass: no generator per row.
"""

import torch

from molt_hpc.protocol.edge import parse
from molt_hpc.protocol.requests import NEUTRAL, GenerateRequest, SamplingParams

__all__ = [
    "NEUTRAL", "GenerateRequest", "SamplingParams", "inverse_cdf", "parse_generate", "processed_logprobs", "sample",
    "seeded_bits",
]  # fmt: skip
MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
"""splitmix64's increment: the stream of seed `s` visits `mix(s) + k·GOLDEN` for k = 1, 2, ..."""


def parse_generate(body: object, vocab_size: int, max_model_len: int) -> GenerateRequest:
    """Validate a decoded JSON body; every problem is a `ValueError` whose message says what to change."""
    req = parse(GenerateRequest, body, "the body (with 'token_ids' and 'sampling_params')")
    sp = req.sampling_params
    for name, neutral in NEUTRAL.items():
        if getattr(sp, name) != neutral:
            raise ValueError(f"sampling_params.{name} = {getattr(sp, name)!r} is not supported; leave it at {neutral}")
    bad = [t for t in (*req.token_ids, *sp.stop_token_ids) if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    if sp.routed_experts_prompt_start >= len(req.token_ids):
        raise ValueError(
            f"sampling_params.routed_experts_prompt_start ({sp.routed_experts_prompt_start}) must be below the "
            f"prompt length ({len(req.token_ids)})"
        )
    total = len(req.token_ids) + (sp.max_tokens or 1)
    if total > max_model_len:
        raise ValueError(
            f"prompt ({len(req.token_ids)} tokens) + max_tokens ({sp.max_tokens}) = {total} exceeds "
            f"engines.max_model_len ({max_model_len}): shorten the prompt or lower max_tokens"
        )
    return req


def processed_logprobs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> torch.Tensor:
    """Log-probs [B, V] of the distribution each row samples from; filtered-out tokens are -inf.

    Per-row parameters are 1-D tensors of length B: `temperature` (0 → 1 for the log-probs, the
    row is greedy), `top_k` (≤ 0 disables), `top_p` (1 disables), `min_p` (0 disables).
    """
    t = torch.where(temperature > 0, temperature, 1.0)
    x = logits.float()
    if bool((t != 1).any()):  # dividing by 1 changes nothing: skip a pass over [B, V]
        x = x / t.to(logits.device)[:, None]
    vocab = x.shape[-1]
    if bool((top_k > 0).any()):
        k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab).to(x.device)
        kth = x.sort(dim=-1, descending=True).values.gather(-1, (k - 1)[:, None])
        x = x.masked_fill(x < kth, float("-inf"))
    if bool((top_p < 1).any()):
        probs, order = x.softmax(-1).sort(dim=-1, descending=True)
        before = probs.cumsum(-1) - probs  # mass of the strictly more likely tokens
        drop_sorted = before >= top_p.to(x.device)[:, None]
        drop_sorted[:, 0] = False
        x = x.masked_fill(torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted), float("-inf"))
    if bool((min_p > 0).any()):
        probs = x.softmax(-1)
        x = x.masked_fill(probs < min_p.to(x.device)[:, None] * probs.max(-1, keepdim=True).values, float("-inf"))
    return x.log_softmax(-1)


def mix64(z: int) -> int:
    """splitmix64's finalizer: every bit of the 64-bit `z` reaches every bit of the result."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def seeded_bits(seed: int, index: int) -> int:
    """32 random bits for token `index` of an answer seeded with `seed`: step `index + 1` of the splitmix64
    stream keyed by the seed, a function of the two numbers alone."""
    return mix64((mix64(seed & MASK64) + (index + 1) * GOLDEN) & MASK64) >> 32


def inverse_cdf(logprobs: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """One token per row of `logprobs [B, V]`, drawn by inverting its cumulative distribution at
    `u = (bits + 0.5) / 2^32` (`bits [B]` int64 in [0, 2^32)): an exact sample for a uniform u, the same
    kernels for every row, no host sync and no generator (a CUDA graph records it as is). Filtered-out
    tokens (-inf) add nothing to the sum, so they are never drawn; the sum runs in float64 (exact enough for
    a vocabulary of millions) over probabilities taken in the log-probs' own precision."""
    cdf = logprobs.exp().cumsum(-1, dtype=torch.float64)
    u = (bits.to(cdf.device, torch.float64) + 0.5) * 2.0**-32 * cdf[:, -1]
    return torch.searchsorted(cdf, u[:, None], right=True).view(-1).clamp_(max=cdf.shape[-1] - 1)


def sample(logprobs: torch.Tensor, greedy: list[bool], bits: list[int]) -> torch.Tensor:
    """One token per row ([B] int64 on the log-probs' device): argmax for greedy rows, else `inverse_cdf`
    of the row's 32 random bits. No host sync: on a GPU the caller reads the tokens back once, together with
    their log-probs."""
    drawn = inverse_cdf(logprobs, torch.tensor(bits, dtype=torch.int64))
    if not any(greedy):
        return drawn
    return torch.where(torch.tensor(greedy, device=drawn.device), logprobs.argmax(-1), drawn)
