"""Exact attention on a CUDA GPU in one fused triton kernel: a query's keys in fixed blocks from its first key.

Under `engines.exact` every mask the engine and the trainer build gives a query one run of keys: a causal
row, left-padded (the engine's cache) or right-padded (the trainer's rows), or one sample of a packed row.
`key_ranges` turns the boolean mask into each query's first key and count of keys
(`runs` keeps them while the same mask comes back). The kernel (one program
per batch row, key head and query; the query heads sharing the key head are its rows) then reads the keys
`first, first + 1, ...` in blocks of `BLOCK` counted from `first`, so a query's blocks hold the same keys
wherever it sits in its batch, and runs the online softmax over them in that order: scores and weighted
values are products of the same tiles, the running maximum, the rescaling and the sums happen in
the same order, and keys past the run are masked to a weight of exactly 0. Nothing a program computes depends
on the other programs, the batch size, the number of queries or the cache's length, so a query gets the same
bits in a decode step of one request as in a training forward of thousands of tokens.

This replaces the block multiplies of `models.exact_blocks` on a GPU (about twenty small kernels per layer
and query chunk, and the key layout built in Python) where `usable` finds, once per head size, dtype and
device, that the kernel gives a query the same bits alone and among others and agrees with plain attention;
where it does not, the block multiplies run for every shape of that head size, so the engine and the trainer
on one GPU type take the same path. Products and sums are float32 (IEEE, no TF32): the 16-bit inputs are
exact in float32.
"""

import threading

import torch
from torch import Tensor

BLOCK = 32
"""Keys per block of the kernel's loop, counted from the query's first key."""
_KERNEL = None
_CHECKED: dict[tuple, bool] = {}
_LOCAL = threading.local()
"""Per thread: the last mask and its runs of keys (`runs`)."""


def _kernel():
    """The triton kernel, compiled on first use (triton is imported only on a GPU)."""
    global _KERNEL
    if _KERNEL is not None:
        return _KERNEL
    import triton
    import triton.language as tl

    @triton.jit
    def attend(q, k, v, o, first, count, nq, nkv, group, d, scaling,
               sqb, sqh, sqq, sqd, skb, skh, skk, skd, svb, svh, svk, svd, sob, soq, soh, sod, srb, srq,
               BG: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr):  # fmt: skip
        pid = tl.program_id(0).to(tl.int64)
        qi, rest = pid % nq, pid // nq
        kh, b = rest % nkv, rest // nkv
        start = tl.load(first + b * srb + qi * srq).to(tl.int64)
        n = tl.load(count + b * srb + qi * srq)
        g, dd = tl.arange(0, BG), tl.arange(0, BD)
        heads = (kh * group + g).to(tl.int64)
        rows, dims = g < group, dd < d
        qt = tl.load(q + b * sqb + heads[:, None] * sqh + qi * sqq + dd[None, :] * sqd,
                     mask=rows[:, None] & dims[None, :], other=0.0).to(tl.float32) * scaling  # fmt: skip
        top = tl.full((BG,), -1e30, tl.float32)  # finite: the first block's rescale is exp(-huge) = 0, not NaN
        den = tl.zeros((BG,), tl.float32)
        acc = tl.zeros((BG, BD), tl.float32)
        kb, vb = k + b * skb + kh * skh, v + b * svb + kh * svh
        for j in range(0, tl.cdiv(n, BN)):  # blocks counted from the query's first key, left to right
            cols = j * BN + tl.arange(0, BN)
            live = cols < n
            keys = (start + cols).to(tl.int64)
            both = live[:, None] & dims[None, :]
            kt = tl.load(kb + keys[:, None] * skk + dd[None, :] * skd, mask=both, other=0.0).to(tl.float32)
            s = tl.dot(qt, tl.trans(kt), input_precision="ieee")
            s = tl.where(live[None, :], s, float("-inf"))  # keys past the run: weight exactly 0
            new = tl.maximum(top, tl.max(s, 1))
            scale = tl.exp(top - new)
            p = tl.exp(s - new[:, None])
            den = den * scale + tl.sum(p, 1)
            vt = tl.load(vb + keys[:, None] * svk + dd[None, :] * svd, mask=both, other=0.0).to(tl.float32)
            acc = acc * scale[:, None] + tl.dot(p, vt, input_precision="ieee")
            top = new
        out = acc / tl.where(den > 0, den, 1.0)[:, None]  # a query with no keys: 0
        tl.store(o + b * sob + qi * soq + heads[:, None] * soh + dd[None, :] * sod,
                 out.to(o.dtype.element_ty), mask=rows[:, None] & dims[None, :])  # fmt: skip

    _KERNEL = attend
    return attend


def key_ranges(allowed: Tensor) -> tuple[Tensor, Tensor] | None:
    """(`[B|1, Q]` first allowed key, `[B|1, Q]` number of allowed keys) of a boolean `[B|1, 1, Q, K]` mask whose
    every query allows one run of consecutive keys; None for any other mask."""
    if allowed.dim() != 4 or allowed.shape[1] != 1:
        return None
    a = allowed[:, 0]
    count = a.sum(-1, dtype=torch.int32)
    first = a.to(torch.uint8).argmax(-1).to(torch.int32)  # the first allowed key (0 where none)
    cols = torch.arange(a.shape[-1], device=a.device)
    run = (cols >= first[..., None]) & (cols < (first + count)[..., None])
    return (first, count) if torch.equal(run, a) else None


def runs(allowed: Tensor) -> tuple[Tensor, Tensor]:
    """`key_ranges` of a mask, kept while the same mask comes back unchanged (every layer of a forward gets the
    same mask object); a ValueError with the fix for a mask that is not one run of keys per query."""
    # an inference tensor has no version counter: a copy of it is kept and compared instead (a sync)
    version = None if allowed.is_inference() else allowed._version
    last = getattr(_LOCAL, "last", None)
    if last and last[0] is allowed and last[1] == version and (version is not None or torch.equal(last[2], allowed)):
        return last[3]
    ranges = key_ranges(allowed)
    if ranges is None:
        raise ValueError("engines.exact on a GPU attends over one run of consecutive keys per query (causal, "
                         "padded or packed rows); this model's mask is another: run exact on the CPU")  # fmt: skip
    _LOCAL.last = (allowed, version, allowed.clone() if version is None else None, ranges)
    return ranges


def attend(q: Tensor, k: Tensor, v: Tensor, first: Tensor, count: Tensor, scaling: float) -> Tensor:
    """`[B, Q, H, D]` outputs of q `[B, H, Q, D]` over k, v `[B, Hkv, K, D]`, each query over keys
    `first .. first + count` (`key_ranges`, broadcast over B)."""
    b, h, nq, d = q.shape
    hkv = k.shape[1]
    assert h % hkv == 0 and k.shape == v.shape and k.shape[0] == b, (q.shape, k.shape, v.shape)
    first, count = first.expand(b, nq), count.expand(b, nq)
    out = torch.empty(b, nq, h, d, dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out
    group = h // hkv
    bg, bd = max(16, 1 << (group - 1).bit_length()), max(16, 1 << (d - 1).bit_length())
    _kernel()[(b * hkv * nq,)](
        q, k, v, out, first, count, nq, hkv, group, d, float(scaling),
        *q.stride(), *k.stride(), *v.stride(), *out.stride(), first.stride(0), first.stride(1),
        BG=bg, BN=BLOCK, BD=bd, num_warps=4,
    )  # fmt: skip
    return out


def _plain(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor, scaling: float) -> Tensor:
    """Masked softmax attention in float32, `[B, Q, H, D]`: what the kernel must agree with."""
    group = q.shape[1] // k.shape[1]
    k, v = (x.float().repeat_interleave(group, dim=1) for x in (k, v))
    scores = (q.float() @ k.transpose(-1, -2)) * scaling
    p = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1).nan_to_num(0.0)
    return (p @ v).transpose(1, 2)


def usable(d: int, heads: int, kv_heads: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the kernel gives a query the same bits alone, among other queries and rows, at other offsets and
    behind other padding, and stays within float32 rounding of plain attention (cached per shape and device)."""
    key = (d, heads, kv_heads, dtype, str(device))
    if key not in _CHECKED:
        gen = torch.Generator().manual_seed(0)
        b, t = 3, 100
        q, k, v = (torch.randn(b, hh, t, d, generator=gen).to(device, dtype) for hh in (heads, kv_heads, kv_heads))
        pos = torch.arange(t, device=device)
        pads = torch.tensor([0, 7, 41], device=device)[:, None, None]
        allowed = ((pos[None, None, :] <= pos[None, :, None]) & (pos[None, None, :] >= pads))[:, None]
        first, count = key_ranges(allowed)
        full = attend(q, k, v, first, count, 0.125)
        same = all(
            torch.equal(attend(q[r : r + 1, :, i : i + 1], k[r : r + 1], v[r : r + 1], first[r : r + 1, i : i + 1],
                               count[r : r + 1, i : i + 1], 0.125), full[r : r + 1, i : i + 1])
            for r, i in ((0, 0), (1, 50), (2, 99), (2, 41))
        )  # fmt: skip
        # the same query's keys moved to another offset of a longer cache (the engine's left padding)
        shift = 13
        k2, v2 = (torch.cat([torch.randn_like(x[:1, :, :shift]), x[2:3]], dim=2) for x in (k, v))
        moved = attend(q[2:3, :, 60:61], k2, v2, first[2:3, 60:61] + shift, count[2:3, 60:61], 0.125)
        same = same and torch.equal(moved, full[2:3, 60:61])
        close = torch.allclose(full.float(), _plain(q, k, v, allowed, 0.125), atol=1e-2, rtol=1e-2)
        _CHECKED[key] = bool(same and close)
    return _CHECKED[key]
