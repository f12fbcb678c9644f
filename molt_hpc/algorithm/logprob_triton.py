"""Triton kernels of the log-prob chunk math (`actor.logprob_kernel = "triton"`, CUDA only).

One program per row of a chunk `raw [n, V]` (the model's dtype), looping over the vocabulary in
blocks of `BLOCK` columns:

- `stats`: one read of the row. An online softmax keeps the running max `m`, `s = Σ exp(z - m)` and
  `t = Σ exp(z - m) z`; at the end lse = m + log s and E_p[z] = t / s; z = raw / temperature in fp32;
- `grad`: one read and one write of the row: dx = p (a z + b) + onehot(y) gl / T with p = exp(z - lse),
  a = -ge / T, b = (ge E_p[z] - gl) / T (the formula of `logprob_kernels.torch_grad`). Each element is
  read before it is written by the same program, so the output may be the input itself.

`TRITON_INTERPRET=1` runs the same kernels on CPU tensors (how the CPU tests check them).
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK = 4096
WARPS = 8


@triton.jit
def _stats_kernel(
    raw_ptr, stride, targets_ptr, logp_ptr, lse_ptr, mean_ptr, inv_temp, V: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    base = raw_ptr + row * stride
    m = -float("inf")
    s = 0.0
    t = 0.0
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        ok = cols < V
        z = tl.load(base + cols, mask=ok, other=0.0).to(tl.float32) * inv_temp
        m_new = tl.maximum(m, tl.max(tl.where(ok, z, -float("inf")), 0))
        e = tl.where(ok, tl.exp(z - m_new), 0.0)
        scale = tl.exp(m - m_new)
        s = s * scale + tl.sum(e, 0)
        t = t * scale + tl.sum(e * z, 0)
        m = m_new
    lse = m + tl.log(s)
    y = tl.load(targets_ptr + row)
    z_y = tl.load(base + y).to(tl.float32) * inv_temp
    tl.store(logp_ptr + row, z_y - lse)
    tl.store(lse_ptr + row, lse)
    tl.store(mean_ptr + row, t / s)


@triton.jit
def _grad_kernel(raw_ptr, raw_stride, out_ptr, out_stride, targets_ptr, lse_ptr, mean_ptr, gl_ptr, ge_ptr, inv_temp,
                 V: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    src = raw_ptr + row * raw_stride
    dst = out_ptr + row * out_stride
    lse = tl.load(lse_ptr + row)
    gl = tl.load(gl_ptr + row)
    ge = tl.load(ge_ptr + row)
    a = -ge * inv_temp
    b = (ge * tl.load(mean_ptr + row) - gl) * inv_temp
    y = tl.load(targets_ptr + row)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        ok = cols < V
        z = tl.load(src + cols, mask=ok, other=0.0).to(tl.float32) * inv_temp
        d = tl.exp(z - lse) * (a * z + b)
        d = tl.where(cols == y, d + gl * inv_temp, d)
        tl.store(dst + cols, d.to(dst.dtype.element_ty), mask=ok)


def _rows(x: Tensor) -> Tensor:
    """A chunk whose rows are contiguous (the kernels index columns with stride 1)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def stats(raw: Tensor, targets: Tensor, temperature: float) -> tuple[Tensor, Tensor, Tensor]:
    raw = _rows(raw)
    n, v = raw.shape
    logp, lse, mean = (torch.empty(n, dtype=torch.float32, device=raw.device) for _ in range(3))
    if n:
        _stats_kernel[(n,)](raw, raw.stride(0), targets.contiguous(), logp, lse, mean, 1.0 / temperature,
                            V=v, BLOCK=BLOCK, num_warps=WARPS)  # fmt: skip
    return logp, lse, mean


def grad(raw, lse, mean_z, targets, gl, ge, temperature: float, out: Tensor) -> Tensor:
    raw = _rows(raw)
    n, v = raw.shape
    gl = torch.zeros_like(lse) if gl is None else gl.to(torch.float32).contiguous()
    ge = torch.zeros_like(lse) if ge is None else ge.to(torch.float32).contiguous()
    target = out if out.stride(-1) == 1 else torch.empty_like(out, memory_format=torch.contiguous_format)
    if n:
        _grad_kernel[(n,)](raw, raw.stride(0), target, target.stride(0), targets.contiguous(), lse, mean_z, gl, ge,
                           1.0 / temperature, V=v, BLOCK=BLOCK, num_warps=WARPS)  # fmt: skip
    return target if target is out else out.copy_(target)
