"""The per-chunk math of `logprobs.py`, in three implementations that compute the same function.

A chunk is `raw [n, V]`: logits in the model's dtype (the LM head's matmul output, or rows of logits the
model produced), never modified. Every kernel gives

- `stats(raw, targets, temperature) -> (log p(target), logsumexp, E_p[z])`, fp32 `[n]` (fp64 for fp64
  models), for `z = raw / temperature`; entropy is `logsumexp - E_p[z]`;
- `grad(raw, lse, mean_z, targets, gl, ge, temperature, out) -> out`: d/d raw of `gl · log p_y + ge · H`
  in `out [n, V]`'s dtype, returned; it is written into `out` unless `out is raw` (a scratch chunk the
  caller no longer needs: the kernel may then write over it or return a buffer of its own).

Kernels (`actor.logprob_kernel`):
- `auto` (the default): `triton` where the chunk is on a CUDA GPU and the triton package is installed,
  `torch` elsewhere. On one H200 the triton kernels are the fastest of the three on the loss alone
  (39 ms against torch's 92 ms at 0.5B) and make the trainer step 14% faster at 0.5B and 1.5B
  (`docs/speed.md`); all three compute the same function;
- `torch`: eager ops on an fp32 copy of the chunk (several passes over `[n, V]` fp32); runs anywhere;
- `compile`: the same math as one `torch.compile`d function per pass (inductor fuses each into one or
  two kernels reading `raw` in its own dtype); any device with a compiler;
- `triton`: two hand-written kernels (`logprob_triton.py`): one online-softmax read of `raw` for the
  stats, one read and one write for the gradient; CUDA only.
"""

import functools
import importlib.util
import os

import torch
from torch import Tensor

KERNELS = ("auto", "torch", "compile", "triton")


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for bf16/fp16/fp32 models; fp64 stays fp64."""
    return torch.promote_types(dtype, torch.float32)


# -- torch: eager ops on an fp32 copy --------------------------------------------------------------


def _scaled_copy(raw: Tensor, temperature: float) -> Tensor:
    z = raw.to(compute_dtype(raw.dtype), copy=True)
    return z.div_(temperature) if temperature != 1.0 else z


def torch_stats(raw: Tensor, targets: Tensor, temperature: float) -> tuple[Tensor, Tensor, Tensor]:
    """One fused softmax gives p; lse = max - log p(argmax) + log sum(p) (p(argmax) >= 1/V never
    underflows), so no separate logsumexp pass is needed."""
    z = _scaled_copy(raw, temperature)
    top, arg = z.max(-1, keepdim=True)
    p = torch.softmax(z, -1)
    # softmax's own normaliser is summed less accurately than torch.sum on CPU: divide it out
    total = p.sum(-1)
    lse = (top - p.gather(1, arg).log_()).squeeze(1) + total.log()
    logp = z.gather(1, targets[:, None]).squeeze(1) - lse
    mean_z = torch.linalg.vecdot(p, z).div_(total)
    return logp, lse, mean_z


def torch_grad(raw, lse, mean_z, targets, gl, ge, temperature: float, out: Tensor) -> Tensor:
    """d log p_y / dz = onehot(y) - p and dH / dz = -p (z - E_p[z]), so with per-row scalars
    a = -ge / temp and b = (ge E_p[z] - gl) / temp: dx = p (a z + b) + onehot(y) gl / temp.
    The target column is fixed up in fp32 so `out` is rounded once."""
    z = _scaled_copy(raw, temperature)
    gl = torch.zeros_like(lse) if gl is None else gl.to(z.dtype)
    b = (-gl if ge is None else ge.to(z.dtype) * mean_z - gl).div_(temperature)[:, None]
    t = b if ge is None else torch.addcmul(b, z, ge.to(z.dtype)[:, None], value=-1.0 / temperature)
    p = z.sub_(lse[:, None]).exp_()
    torch.mul(p, t, out=out)
    col = targets[:, None]
    t_y = t if ge is None else t.gather(1, col)
    at_y = p.gather(1, col).mul_(t_y).add_(gl[:, None], alpha=1.0 / temperature)
    return out.scatter_(1, col, at_y.to(out.dtype))


# -- compile: the same math, fused by inductor -----------------------------------------------------


def _stats_math(raw: Tensor, targets: Tensor, inv_temp: float) -> tuple[Tensor, Tensor, Tensor]:
    z = raw.to(compute_dtype(raw.dtype)) * inv_temp
    lse = torch.logsumexp(z, -1)
    mean_z = (torch.exp(z - lse[:, None]) * z).sum(-1)
    logp = z.gather(1, targets[:, None]).squeeze(1) - lse
    return logp, lse, mean_z


def _grad_math(raw, lse, mean_z, targets, gl, ge, inv_temp: float) -> Tensor:
    z = raw.to(lse.dtype) * inv_temp
    p = torch.exp(z - lse[:, None])
    d = p * ((-ge * inv_temp)[:, None] * z + ((ge * mean_z - gl) * inv_temp)[:, None])
    hit = torch.arange(z.shape[1], device=z.device)[None, :] == targets[:, None]
    return torch.where(hit, d + (gl * inv_temp)[:, None], d).to(raw.dtype)


_compiled: dict[str, object] = {}


def _compiled_fn(name: str, fn):
    if name not in _compiled:
        # dynamic: the last chunk of every call has its own row count; one graph serves them all
        _compiled[name] = torch.compile(fn, dynamic=True)
    return _compiled[name]


def compile_stats(raw: Tensor, targets: Tensor, temperature: float) -> tuple[Tensor, Tensor, Tensor]:
    return _compiled_fn("stats", _stats_math)(raw, targets, 1.0 / temperature)


def compile_grad(raw, lse, mean_z, targets, gl, ge, temperature: float, out: Tensor) -> Tensor:
    gl = torch.zeros_like(lse) if gl is None else gl.to(lse.dtype)
    ge = torch.zeros_like(lse) if ge is None else ge.to(lse.dtype)
    d = _compiled_fn("grad", _grad_math)(raw, lse, mean_z, targets, gl, ge, 1.0 / temperature)
    return d if out is raw else out.copy_(d)  # `out is raw`: a scratch chunk, any buffer will do


# -- dispatch --------------------------------------------------------------------------------------


def check_kernel(kernel: str, device: torch.device | str) -> None:
    """Refuse a kernel this device cannot run, with what to change."""
    _check_kernel(kernel, torch.device(device).type)


@functools.cache
def _check_kernel(kernel: str, device_type: str) -> None:
    if kernel not in KERNELS:
        raise ValueError(f"actor.logprob_kernel = {kernel!r}: choose one of {', '.join(KERNELS)}")
    if kernel != "triton":
        return
    if device_type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"actor.logprob_kernel = 'triton' runs on CUDA GPUs, this trainer is on {device_type}: "
            "set actor.logprob_kernel = 'torch' (or 'compile')"
        )
    if not _has_triton():
        raise ValueError("actor.logprob_kernel = 'triton' needs the triton package: pip install triton, or use 'torch'")


def resolve_kernel(kernel: str, device_type: str) -> str:
    """The kernel that `auto` means on `device_type`; any other kernel is itself."""
    if kernel != "auto":
        return kernel
    return "triton" if device_type == "cuda" and _has_triton() else "torch"


@functools.cache
def _has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def kernel_fns(kernel: str, dtype: torch.dtype, device_type: str = "cpu"):
    """(stats, grad) of `kernel` for chunks of `dtype` on `device_type`; fp64 chunks always take the
    torch kernel (the fused kernels accumulate in fp32)."""
    kernel = resolve_kernel(kernel, device_type)
    if kernel == "torch" or dtype == torch.float64:
        return torch_stats, torch_grad
    if kernel == "compile":
        return compile_stats, compile_grad
    if kernel == "triton":
        from molt_hpc.algorithm.logprob_triton import grad, stats

        return stats, grad
    raise ValueError(f"unknown log-prob kernel {kernel!r}; choose one of {', '.join(KERNELS)}")
