"""Moving values between the token layout `[B, T]` and the per-sample layout `[N]` / `[N, L]`.

A batch row holds one sample (padded) or several (packed), so every token carries `seq_index`, the
index of its sample in `0..N-1` (`-1` on padding). The helpers here let the RL math work per sample
without caring how samples were laid out in rows:

- `broadcast_to_tokens`: a per-sample scalar onto that sample's action tokens;
- `sum_per_sample` / `count_per_sample`: reductions of action tokens per sample;
- `to_sample_major` / `from_sample_major`: gather each sample's *action tokens only*, in order, into a
  dense right-padded `[N, L]` (L = most action tokens of any sample) and scatter back. Recursions over
  time (GAE, discounted returns) run there, so prompt and env-feedback tokens are skipped and
  samples never leak into one another, whether rows are padded or packed.
"""

import torch
from torch import Tensor


def _action_sample_ids(seq_index: Tensor, action_mask: Tensor, n_samples: int) -> Tensor:
    ids = seq_index[action_mask]
    assert ids.numel() == 0 or (ids.min() >= 0 and ids.max() < n_samples), "action token outside any sample"
    return ids


def broadcast_to_tokens(per_sample: Tensor, seq_index: Tensor, action_mask: Tensor) -> Tensor:
    """`[N]` values placed on every action token of their sample, 0 elsewhere: `[B, T]`."""
    idx = seq_index.clamp(min=0)
    return torch.where(action_mask, per_sample[idx], torch.zeros((), dtype=per_sample.dtype))


def sum_per_sample(values: Tensor, seq_index: Tensor, action_mask: Tensor, n_samples: int) -> Tensor:
    """Sum of `values [B, T]` over each sample's action tokens: `[N]` (gradients flow)."""
    ids = _action_sample_ids(seq_index, action_mask, n_samples)
    out = torch.zeros(n_samples, dtype=values.dtype, device=values.device)
    return out.index_add(0, ids, values[action_mask])


def count_per_sample(seq_index: Tensor, action_mask: Tensor, n_samples: int) -> Tensor:
    """Action tokens of each sample: `[N]` int64."""
    ids = _action_sample_ids(seq_index, action_mask, n_samples)
    return torch.bincount(ids, minlength=n_samples)


def _sample_major_index(seq_index: Tensor, action_mask: Tensor, n_samples: int) -> tuple[Tensor, Tensor, int]:
    """(sample id, rank within the sample) of every action token in row-major order, and the width L."""
    ids = _action_sample_ids(seq_index, action_mask, n_samples)
    order = torch.arange(ids.numel(), device=ids.device)
    # A sample's action tokens are contiguous in row-major order (one row, increasing t), so the
    # rank of a token is its distance from the first action token of its sample.
    first = torch.full((n_samples,), ids.numel(), dtype=order.dtype, device=ids.device)
    first = first.scatter_reduce(0, ids, order, reduce="amin")
    rank = order - first[ids]
    width = int(rank.max().item()) + 1 if rank.numel() else 0
    return ids, rank, width


def to_sample_major(values: Tensor, seq_index: Tensor, action_mask: Tensor, n_samples: int) -> tuple[Tensor, Tensor]:
    """Each sample's action-token values in order, right-padded with 0: (`[N, L]`, valid mask `[N, L]`)."""
    ids, rank, width = _sample_major_index(seq_index, action_mask, n_samples)
    dense = torch.zeros(n_samples, width, dtype=values.dtype, device=values.device)
    valid = torch.zeros(n_samples, width, dtype=torch.bool, device=values.device)
    dense[ids, rank] = values[action_mask]
    valid[ids, rank] = True
    return dense, valid


def from_sample_major(dense: Tensor, seq_index: Tensor, action_mask: Tensor) -> Tensor:
    """Inverse of `to_sample_major`: `[N, L]` back onto the action tokens of `[B, T]`, 0 elsewhere."""
    ids, rank, _ = _sample_major_index(seq_index, action_mask, dense.shape[0])
    out = torch.zeros(action_mask.shape, dtype=dense.dtype, device=dense.device)
    out[action_mask] = dense[ids, rank]
    return out


def row_seq_index(action_mask: Tensor) -> Tensor:
    """The `seq_index` of a padded batch (row b is sample b), for callers that have no packing."""
    rows = torch.arange(action_mask.shape[0], device=action_mask.device)
    return rows[:, None].expand_as(action_mask).contiguous()
