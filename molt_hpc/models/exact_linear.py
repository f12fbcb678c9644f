"""The batch-invariant matrix multiply of `engines.exact`: `exact_linear(x, weight, bias)` gives every row of `x`
the same bits whatever the other rows (their number, their position). The CPU's BLAS picks its kernel by the
row count; a multiply padded to a multiple of `ROWS` rows computes each row the same way wherever it sits
(checked once per shape by `linear_is_invariant`); where that does not hold, each element is an elementwise
product summed by a strictly sequential `cumsum`. On a CUDA GPU the multiply is `models.exact_cuda`'s triton
kernel of fixed tiles (the same check runs on it). Used by `models.exact` (linear layers, the LM head) and the
MoE routers and experts (`models.exact_moe`, `models.router_replay`)."""

import torch
import torch.nn.functional as F
from torch import Tensor

ROWS = 16
"""Rows of one block of the exact matrix multiply: every multiply has a multiple of this many rows."""
_CHECKED: dict[tuple, bool] = {}


def padded_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    if x.is_cuda:  # cuBLAS picks its kernel by shape: one triton kernel of fixed tiles instead, no padding needed
        from molt_hpc.models.exact_cuda import linear

        out = linear(x, weight)
        return out if bias is None else out + bias
    n = x.shape[0]
    if n % ROWS == 0 and x.is_contiguous():  # already a padded shape: no copy
        return F.linear(x, weight, bias)
    return F.linear(F.pad(x, (0, 0, 0, (-n) % ROWS)), weight, bias)[:n]


def sequential_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    step = max(1, (1 << 22) // max(1, weight.numel()))
    out = torch.cat([(x[i : i + step, None, :] * weight).cumsum(-1)[..., -1] for i in range(0, x.shape[0], step)])
    return out if bias is None else out + bias


def linear_is_invariant(k: int, n: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the padded multiply gives each row the same bits alone and among others (cached per shape)."""
    key = (k, n, dtype, str(device))
    if key not in _CHECKED:
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(n, k, generator=gen).to(device, dtype)
        x = torch.randn(3 * ROWS + 5, k, generator=gen).to(device, dtype)
        alone = torch.cat([padded_linear(x[i : i + 1], w, None) for i in range(0, x.shape[0], 7)])
        among = padded_linear(x, w, None)[::7]
        shifted = padded_linear(x[3:], w, None)[4::7]
        whole = padded_linear(x[7 : 7 + 2 * ROWS], w, None)[::7]  # a multiple of ROWS rows: not padded
        _CHECKED[key] = torch.equal(alone, among) and torch.equal(alone[1:], shifted) and torch.equal(alone[1:6], whole)
    return _CHECKED[key]


def exact_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """`F.linear(x, weight, bias)` whose every row's result does not depend on the other rows."""
    lead = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1])
    if linear_is_invariant(weight.shape[1], weight.shape[0], weight.dtype, weight.device):
        out = padded_linear(flat, weight, bias)
    elif x.is_cuda:  # a GPU's cumsum is a parallel scan: no sequential form to fall back on
        raise RuntimeError(f"engines.exact: the fixed-tile multiply gave a row other bits on this GPU ({weight.shape})")
    else:
        out = sequential_linear(flat, weight, bias)
    return out.reshape(*lead, weight.shape[0])
