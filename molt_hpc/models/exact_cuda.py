"""The batch-invariant matrix multiply of `engines.exact` on a CUDA GPU: one triton kernel of fixed tiles.

cuBLAS picks its kernel (tile shape, split-K) by the problem's shape, so a row multiplied among 2,000 others
(a training forward) gets other bits than the same row in a decode step of 8. `matmul` runs one kernel
whose tiles depend on the dtype only: every output element is its row's dot product with its column, added
tile after tile along K in one fixed order (no split-K), and the tensor core computes a tile's rows
independently of each other. So an element's bits do not depend on the number of rows, the row's place
in its tile, the number of matrices in the batch, or the strides of the operands. float32 operands use
IEEE multiplies (no TF32); 16-bit ones accumulate in float32.

`linear(x, weight)` is `x @ weight.T` through it with a plain backward (gradients need not be exact; the
importance ratio compares forward values), `rowsum(x)` a row's sum by the same kernel (RMSNorm's mean).
`models.exact_linear` and `models.exact_blocks` call these on CUDA; the CPU keeps its own forms.
"""

import torch
from torch import Tensor

_KERNEL = None


def _tiles(dtype: torch.dtype) -> dict:
    """The fixed tile of a dtype: the only thing that decides the order of an element's additions."""
    if dtype == torch.float32:
        return {"BM": 32, "BN": 32, "BK": 32, "PRECISION": "ieee", "num_warps": 4}
    return {"BM": 64, "BN": 64, "BK": 64, "PRECISION": "tf32", "num_warps": 4}  # 16-bit: the mode is unused


def _kernel():
    """The triton kernel, compiled on first use (triton is imported only on a GPU)."""
    global _KERNEL
    if _KERNEL is not None:
        return _KERNEL
    try:
        import triton
        import triton.language as tl
    except ImportError as err:
        raise ValueError("engines.exact on a GPU needs the triton package: pip install triton") from err

    @triton.jit
    def mm(a, b, c, M, N, K, inner,
           sa0, sa1, sam, sak, sb0, sb1, sbk, sbn, sc0, sc1, scm, scn,
           BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
        bid = tl.program_id(0)  # the batch on the grid's first axis: the others stop at 65,535
        outer, within = bid // inner, bid % inner
        rm = (tl.program_id(1) * BM + tl.arange(0, BM)).to(tl.int64)
        rn = (tl.program_id(2) * BN + tl.arange(0, BN)).to(tl.int64)
        rk = tl.arange(0, BK).to(tl.int64)
        a += outer.to(tl.int64) * sa0 + within.to(tl.int64) * sa1
        b += outer.to(tl.int64) * sb0 + within.to(tl.int64) * sb1
        c += outer.to(tl.int64) * sc0 + within.to(tl.int64) * sc1
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        rows, cols = rm[:, None] < M, rn[None, :] < N
        for i in range(0, tl.cdiv(K, BK)):  # along K in one order, whatever M, N or the batch
            ka = i * BK + rk
            x = tl.load(a + rm[:, None] * sam + ka[None, :] * sak, mask=rows & (ka[None, :] < K), other=0.0)
            y = tl.load(b + ka[:, None] * sbk + rn[None, :] * sbn, mask=(ka[:, None] < K) & cols, other=0.0)
            acc = tl.dot(x, y, acc, input_precision=PRECISION)
        tl.store(c + rm[:, None] * scm + rn[None, :] * scn, acc.to(c.dtype.element_ty), mask=rows & cols)

    _KERNEL = mm
    return mm


def _batch_strides(t: Tensor) -> tuple[int, int]:
    """(outer, inner) strides of a four-dim view's two batch dims."""
    return t.stride(0), t.stride(1)


def matmul(a: Tensor, b: Tensor, out: Tensor | None = None) -> Tensor:
    """`a @ b` for `a [..., M, K]`, `b [..., K, N]` with at most two batch dims (broadcast like `torch.matmul`,
    strides of 0 allowed), every element computed in one fixed order (module docstring)."""
    assert a.is_cuda and a.dtype == b.dtype, (a.device, a.dtype, b.dtype)
    assert a.dim() <= 4 and b.dim() <= 4, "at most two batch dims"
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    assert b.shape[-2] == k, (a.shape, b.shape)
    if out is None:
        out = torch.empty(*batch, m, n, dtype=a.dtype, device=a.device)
    assert out.shape == (*batch, m, n), (out.shape, batch, m, n)
    lead = (None,) * (2 - len(batch))  # views throughout: a broadcast dim keeps its stride of 0, nothing copied
    a4, b4, c4 = a.expand(*batch, m, k)[lead], b.expand(*batch, k, n)[lead], out[lead]
    if m == 0 or n == 0 or c4.shape[0] * c4.shape[1] == 0:
        return out
    tiles = _tiles(a.dtype)
    warps = tiles.pop("num_warps")
    grid = (c4.shape[0] * c4.shape[1], triton_cdiv(m, tiles["BM"]), triton_cdiv(n, tiles["BN"]))
    _kernel()[grid](
        a4, b4, c4, m, n, k, c4.shape[1],
        *_batch_strides(a4), a4.stride(2), a4.stride(3),
        *_batch_strides(b4), b4.stride(2), b4.stride(3),
        *_batch_strides(c4), c4.stride(2), c4.stride(3),
        num_warps=warps, **tiles,
    )  # fmt: skip
    return out


def triton_cdiv(x: int, y: int) -> int:
    return -(-x // y)


class _Linear(torch.autograd.Function):
    """`x [M, K] @ weight.T` forward through `matmul`; the backward is plain torch."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor) -> Tensor:
        ctx.save_for_backward(x, weight)
        return matmul(x, weight.t())

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight = ctx.saved_tensors
        gx = grad @ weight if ctx.needs_input_grad[0] else None
        gw = grad.t() @ x if ctx.needs_input_grad[1] else None
        return gx, gw


def linear(x: Tensor, weight: Tensor) -> Tensor:
    """`F.linear(x, weight)` for 2-D `x`, each row's bits independent of the other rows."""
    if x.dtype != weight.dtype:
        raise ValueError(f"exact linear: input {x.dtype} against weight {weight.dtype} (F.linear refuses it too)")
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _Linear.apply(x, weight)
    return matmul(x, weight.t())


def rowsum(x: Tensor) -> Tensor:
    """`x.sum(-1, keepdim=True)` of a float32 `[..., H]`, each row added in one fixed order (a multiply by a
    column of ones; differentiable)."""
    ones = torch.ones(1, x.shape[-1], dtype=x.dtype, device=x.device)
    flat = x.reshape(-1, x.shape[-1])
    return linear(flat, ones).view(*x.shape[:-1], 1)
