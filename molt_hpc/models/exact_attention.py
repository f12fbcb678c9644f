"""Attention whose every output is the same bits whatever else sits in the batch (`engines.exact`).

`exact_attention(q, k, v, allowed, scaling)` gives a query, bit for bit, what it gets attending over exactly
its allowed keys alone, whatever the other queries, the padding and the cache's length. The engine's decode
(one query over a left-padded KV cache), its prefill (left-padded rows), the trainer's padded rows and its
packed rows (a causal block per sample) then agree to the last bit. Two forms compute it:

- block matrix multiplies (`models.exact_blocks`): each query's keys are laid out at the same block columns
  whatever the batch, fixed-shape multiplies give the scores and the weighted values block by block, and the
  blocks add left to right. Used where this device's multiplies give a row the same bits whatever the other
  rows (`exact_blocks.block_rows`, checked once per head size, dtype and device);
- elsewhere, the sequential form (`_core`): a score is the elementwise product q·k summed by `cumsum` over the
  head dimension (its last element); the softmax's maximum is over the allowed keys (a maximum is exact in
  any order); its denominator and the probability-weighted sum of values are `cumsum`s over the keys, last
  element taken. On the CPU `cumsum` accumulates one element after the other, so a masked key (probability
  exp(-inf) = 0) or a column of padding adds an exact zero. On this project's CPU it was 7x slower than the
  blocks for a decode step, 16x for 64 rows of 56 tokens, 70x for 8 rows of 512.

On a CUDA GPU a third form runs where it passes its check: one fused kernel per layer
(`models.exact_cuda_attention`), each query's run of keys read in fixed blocks from its first key.

The forms give different bits: a process uses one of them for every shape of a head size, and the
engine and the trainer on one CPU type get the same answer from the check.

The backward pass recomputes plain masked softmax attention and differentiates it (gradients need not
be exact; the forward values are what the importance ratio compares). `exact_attention_forward` is the
function registered with transformers' `AttentionInterface` as `molt_exact`, and `exact_documents` the
kernel of the trainer's document attention (`parallel.attention`) for packed rows.
"""

import torch
from torch import Tensor

from molt_hpc.models.exact_blocks import block_rows, blocked_attention

ATTENTION = "molt_exact"
BUDGET = 1 << 22
"""Most elements of one query chunk's `[B, H, q, K, D]` products."""


def _expand(x: Tensor, heads: int) -> Tensor:
    b, kv, t, d = x.shape
    return x if kv == heads else x[:, :, None].expand(b, kv, heads // kv, t, d).reshape(b, heads, t, d)


def _core(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor, scaling: float) -> Tensor:
    """`[B, H, Q, D]` outputs; `allowed` is a bool `[B|1, H|1, Q, K]`. A query with no allowed key gets 0."""
    b, h, nq, d = q.shape
    nk = k.shape[2]
    step = max(1, BUDGET // max(1, b * h * nk * d))
    outs = []
    for lo in range(0, nq, step):
        qc, ac = q[:, :, lo : lo + step], allowed[:, :, lo : lo + step]
        scores = (qc[:, :, :, None, :] * k[:, :, None]).cumsum(-1)[..., -1] * scaling  # [B, H, q, K]
        scores = scores.masked_fill(~ac, float("-inf"))
        top = scores.amax(-1, keepdim=True)
        top = top.masked_fill(~torch.isfinite(top), 0.0)
        p = (scores - top).exp()  # masked keys: exp(-inf) = 0 exactly
        den = p.cumsum(-1)[..., -1:].clamp(min=1.0)  # >= 1 when any key is allowed (its maximum gives exp(0))
        num = (p[..., None] * v[:, :, None]).cumsum(-2)[..., -1, :]
        outs.append(num / den)
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


def _reference(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor, scaling: float) -> Tensor:
    """Plain masked softmax attention: the function whose gradient the backward pass takes."""
    scores = (q @ k.transpose(-1, -2)) * scaling
    scores = scores.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return p @ v


def _forward(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor, scaling: float) -> Tensor:
    """`[B, Q, H, D]`: on a GPU the fused kernel (`models.exact_cuda_attention`) where it passed its check; else
    block multiplies (`models.exact_blocks`) where this device's multiplies are row-invariant, else the
    sequential `cumsum` form."""
    if q.is_cuda:
        from molt_hpc.models.exact_cuda_attention import attend, runs, usable

        if usable(q.shape[-1], q.shape[1], k.shape[1], q.dtype, q.device):
            return attend(q, k, v, *runs(allowed[(None,) * (4 - allowed.dim())]), scaling)
    rows = block_rows(q.shape[-1], torch.promote_types(q.dtype, torch.float32), q.device)
    if rows:
        return blocked_attention(q, k, v, allowed[(None,) * (4 - allowed.dim())], scaling, rows)
    if q.is_cuda:  # a GPU's cumsum is a parallel scan: the sequential form is not sequential there
        d = q.shape[-1]
        raise RuntimeError(f"engines.exact: the fixed-tile multiplies gave a row other bits on this GPU (head {d})")
    heads = q.shape[1]
    return _core(q, _expand(k, heads), _expand(v, heads), allowed, scaling).transpose(1, 2).contiguous()


class _Exact(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, allowed, scaling):
        ctx.save_for_backward(q, k, v, allowed)
        ctx.scaling = scaling
        return _forward(q, k, v, allowed, scaling)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, allowed = ctx.saved_tensors
        with torch.enable_grad():
            inputs = [
                x.detach().requires_grad_(need) for x, need in zip((q, k, v), ctx.needs_input_grad[:3], strict=True)
            ]
            q, k, v = inputs
            out = _reference(q, _expand(k, q.shape[1]), _expand(v, q.shape[1]), allowed, ctx.scaling).transpose(1, 2)
            wanted = [x for x in inputs if x.requires_grad]
            grads = iter(torch.autograd.grad(out, wanted, grad)) if wanted else iter(())
        return (*(next(grads) if x.requires_grad else None for x in inputs), None, None)


def exact_attention(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor, scaling: float | None = None) -> Tensor:
    """q `[B, H, Q, D]`, k and v `[B, Hkv, K, D]`, `allowed` bool broadcastable to `[B, H, Q, K]` ->
    `[B, Q, H, D]` (the layout transformers' attention functions return)."""
    scale = q.shape[-1] ** -0.5 if scaling is None else float(scaling)
    if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
        out = _Exact.apply(q, k, v, allowed, scale)
    else:  # the engine and the old-policy forward: no autograd node to build
        out = _forward(q, k, v, allowed, scale)
    return out


def causal(nq: int, nk: int, device) -> Tensor:
    """`[1, 1, Q, K]`: the Q queries are the last Q of the K positions."""
    qi = torch.arange(nk - nq, nk, device=device)[:, None]
    return (torch.arange(nk, device=device)[None] <= qi)[None, None]


def exact_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                            sliding_window=None, **kwargs):  # fmt: skip
    """The `molt_exact` attention function: transformers' boolean mask (True = attend), or causal when the
    mask was skipped."""
    if sliding_window is not None or kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        raise ValueError("engines.exact runs plain causal softmax attention: no sliding window, softcap, sinks")
    assert dropout == 0.0, "exact attention runs without dropout (the trainer turns it off, the engine evaluates)"
    nq, nk = query.shape[2], key.shape[2]
    if attention_mask is None:
        allowed = causal(nq, nk, query.device)
    else:
        assert attention_mask.dtype == torch.bool, "the molt_exact mask function gives boolean masks"
        allowed = attention_mask[:, :, :, :nk]
    return exact_attention(query, key, value, allowed, scaling), None


def exact_documents(q: Tensor, k: Tensor, v: Tensor, spans: list[tuple[int, int]], scaling) -> Tensor:
    """Packed rows: `[B, H, T, D]` q, k, v whose samples are `spans` of the flattened `B·T` positions,
    each attending causally to itself only -> `[B, T, H, D]`, 0 at positions of no span (padding).

    Samples of about one length (lengths up to the same power of two) run as one batch, each right-padded
    to the longest: padding keys after a query are masked, which adds exact zeros."""
    b, h, t, d = q.shape
    flat = [x.transpose(1, 2).reshape(b * t, x.shape[1], d) for x in (q, k, v)]
    groups: dict[int, list[tuple[int, int]]] = {}
    for lo, hi in spans:
        groups.setdefault((hi - lo - 1).bit_length(), []).append((lo, hi))
    places, values = [], []
    for group in groups.values():
        longest = max(hi - lo for lo, hi in group)
        starts = torch.tensor([lo for lo, _ in group], device=q.device)[:, None]
        lengths = torch.tensor([hi - lo for lo, hi in group], device=q.device)[:, None]
        cols = torch.arange(longest, device=q.device)[None]
        real = cols < lengths  # [n, L]
        where = (starts + cols).clamp(max=b * t - 1)  # a padding query reads any position: its keys are masked
        docs = [x[where].transpose(1, 2) for x in flat]  # [n, H, L, D]
        allowed = causal(longest, longest, q.device) & real[:, None, None, :]
        places.append(where[real])
        values.append(exact_attention(*docs, allowed, scaling)[real])  # [m, H, D]
    out = torch.zeros(b * t, h, d, dtype=q.dtype, device=q.device)
    if places:
        out = out.index_copy(0, torch.cat(places), torch.cat(values))
    return out.reshape(b, t, h, d)


def exact_mask(*args, **kwargs):
    """The mask function registered with `molt_exact`: transformers' boolean SDPA mask, never skipped."""
    from transformers.masking_utils import sdpa_mask

    kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)


def register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION, exact_attention_forward)
    AttentionMaskInterface.register(ATTENTION, exact_mask)
