"""The train–inference mismatch observatory: how far the trainer's log-probs are from the engine's for
the same tokens *and the same weights*.

Only tokens sampled under the weights the trainer holds now count (`versions == version`): for them
any gap between the trainer's log-prob and the engine's is mismatch (kernels, precision, batch
shape), not staleness. With `d = logp_trainer - logp_engine` per such token:

- `mismatch_abs_mean`, `mismatch_abs_max`: mean and max of `|d|`;
- `mismatch_k3`: the k3 estimate of KL(engine ‖ trainer) from the engine's samples,
  `exp(d) - 1 - d` (non-negative, 0 only where the two agree);
- `mismatch_ppl_ratio`: the trainer's perplexity over the engine's on these tokens,
  `exp(mean(-logp_trainer)) / exp(mean(-logp_engine)) = exp(-mean(d))` (the trainer reports its log,
  `mismatch_log_ppl_ratio`, which sums across micro-batches; `finish` turns it into the ratio);
- `mismatch_over_threshold`: the fraction of tokens whose ratio `exp(|d|)` exceeds the IS threshold
  (`algorithm.is_threshold`) in either direction: the tokens an IS correction would truncate or mask
  if the weights were the same;
- the same mean `|d|` split by the sample's response length (`mismatch_abs_mean_len_<edge>`: samples
  of fewer action tokens than `edge`, `_len_ge_<last>` for the rest) and by turn of a multi-turn
  sample (`mismatch_abs_mean_turn_<k>`, the k-th span of action tokens, from 1; turns past
  `MAX_TURNS` count as the last);
- `mismatch_tokens`: how many tokens the numbers are over.

`observe` returns `(metrics, tokens)` pairs, each a token-weighted mean over its own tokens, in the
form the step's meter reduces over micro-batches and ranks (`mismatch_abs_max` is a max).
"""

import math

import torch
from torch import Tensor

LENGTH_EDGES = (256, 1024, 4096)
"""Response-length bucket edges (action tokens of the sample)."""
MAX_TURNS = 4


def observe(
    logp_trainer: Tensor,
    logp_engine: Tensor,
    action_mask: Tensor,
    versions: Tensor,
    version: int,
    seq_index: Tensor,
    is_threshold: float,
) -> list[tuple[dict[str, Tensor], int]]:
    """The mismatch metrics of one micro-batch (`[B, T]` tensors, padded or packed) as weighted parts."""
    same = action_mask & (versions == version)
    tokens = int(same.sum())
    if tokens == 0:
        return []
    d = (logp_trainer.detach().double() - logp_engine.double())[same]
    overall = {
        "mismatch_abs_mean": d.abs().mean(),
        "mismatch_abs_max": d.abs().max(),
        "mismatch_k3": (torch.expm1(d) - d).mean(),
        "mismatch_log_ppl_ratio": (-d).mean(),
        "mismatch_over_threshold": (d.abs() > math.log(is_threshold)).double().mean(),
        "mismatch_tokens": torch.tensor(float(tokens), dtype=torch.float64),
    }
    parts = [(overall, tokens)]
    turns = turn_numbers(action_mask, seq_index)
    by_turn = _turn_buckets(turns[same]) if int(turns.max()) > 1 else []  # single-turn: it would repeat the mean
    for name, sel in [*_length_buckets(_response_lengths(action_mask, seq_index)[same]), *by_turn]:
        n = int(sel.sum())
        if n:
            parts.append(({f"mismatch_abs_mean_{name}": d[sel].abs().mean()}, n))
    return parts


def finish(metrics: dict[str, float]) -> dict[str, float]:
    """After the reduction: the perplexity ratio from its mean log; `mismatch_tokens` as a count."""
    out = dict(metrics)
    if "mismatch_log_ppl_ratio" in out:
        out["mismatch_ppl_ratio"] = math.exp(out.pop("mismatch_log_ppl_ratio"))
    return out


def _response_lengths(action_mask: Tensor, seq_index: Tensor) -> Tensor:
    """`[B, T]`: the action-token count of the sample each token belongs to."""
    sample = torch.where(action_mask, seq_index, -1)
    n = int(seq_index.max()) + 1 if seq_index.numel() else 0
    counts = torch.bincount(sample[sample >= 0], minlength=n)
    return torch.where(seq_index >= 0, counts[seq_index.clamp(min=0)], 0)


def turn_numbers(action_mask: Tensor, seq_index: Tensor) -> Tensor:
    """`[B, T]`: which span of action tokens (1, 2, ...) of its sample a token is in; 0 off the actions."""
    prev_mask = torch.nn.functional.pad(action_mask[:, :-1], (1, 0), value=False)
    prev_seq = torch.nn.functional.pad(seq_index[:, :-1], (1, 0), value=-1)
    starts = action_mask & (~prev_mask | (prev_seq != seq_index))
    # spans started so far in this sample: a running count per row, minus the count before the sample began
    run = starts.long().cumsum(1)
    first = torch.nn.functional.pad(seq_index[:, :-1], (1, 0), value=-1) != seq_index
    base = torch.where(first, run - starts.long(), 0)
    base = torch.cummax(torch.where(first, base, torch.zeros_like(base)), 1).values
    return torch.where(action_mask, run - base, 0)


def _length_buckets(lengths: Tensor) -> list[tuple[str, Tensor]]:
    out, low = [], 0
    for edge in LENGTH_EDGES:
        out.append((f"len_lt_{edge}", (lengths >= low) & (lengths < edge)))
        low = edge
    out.append((f"len_ge_{LENGTH_EDGES[-1]}", lengths >= LENGTH_EDGES[-1]))
    return out


def _turn_buckets(turns: Tensor) -> list[tuple[str, Tensor]]:
    capped = turns.clamp(max=MAX_TURNS)
    return [(f"turn_{k}", capped == k) for k in range(1, MAX_TURNS + 1)]
