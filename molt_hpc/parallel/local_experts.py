"""The experts this rank holds under expert parallelism, run on the rows sent to them: one grouped GEMM per
weight, as transformers' grouped_mm path computes them. Both dispatches use it (`expert`'s
all-to-all, `deepep`'s DeepEP kernels); the local expert weights pass through `scale_grad(1/ep)` (see
`expert` on the gradient scale).
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor


@dataclass(frozen=True)
class EPGroup:
    """What one experts module needs at run time: its EP process group and this rank's place in it."""

    group: dist.ProcessGroup
    size: int
    rank: int


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


def scale_grad(x: torch.Tensor, scale: float) -> torch.Tensor:
    """`x` in the forward; its gradient times `scale` in the backward."""
    return x if scale == 1.0 else _ScaleGrad.apply(x, scale)


def local(module: nn.Module, name: str) -> torch.Tensor:
    """This rank's experts of parameter `name` (`[E/ep, ...]`), their gradient scaled by 1/ep."""
    p = getattr(module, name)
    if not isinstance(p, DTensor):
        return p
    return scale_grad(p.to_local(), 1.0 / module._molt_ep.size)


def grouped_linear(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, transposed: bool) -> torch.Tensor:
    """`x` rows times their group's weight (`w [G, out, in]`, or `[G, in, out]` when `transposed`)."""
    w = w if transposed else w.transpose(-2, -1)
    x = x.to(w.dtype)
    if hasattr(torch.nn.functional, "grouped_mm"):
        return torch.nn.functional.grouped_mm(x, w, offs=offs)
    return torch._grouped_mm(x, w, offs=offs)


def local_experts_mlp(
    module: nn.Module, x: torch.Tensor, local_ids: torch.Tensor, rows_per_expert: torch.Tensor
) -> torch.Tensor:
    """The local experts on rows `x` sorted by local expert id (`local_ids`), as transformers' grouped_mm
    path computes them (gate or not, bias or not, either weight layout)."""
    offs = torch.cumsum(rows_per_expert, dim=0, dtype=torch.int32)
    first = "gate_up_proj" if module.has_gate else "up_proj"
    h = grouped_linear(x, local(module, first), offs, module.is_transposed)
    if module.has_bias:
        h = h + local(module, first + "_bias")[local_ids]
    h = module._apply_gate(h) if module.has_gate else module.act_fn(h)
    y = grouped_linear(h, local(module, "down_proj"), offs, module.is_transposed)
    if module.has_bias:
        y = y + local(module, "down_proj_bias")[local_ids]
    if getattr(module, "has_post_expert_norm", False):
        y = module.post_expert_norm(y)
    return y
