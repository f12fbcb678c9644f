"""Fused projections for the engine's forwards: one matmul for q/k/v and one for gate/up per layer.

A decode step of a small model is bound by kernel count as much as by bytes: every projection is its
own launch. `fuse_projections(model)` concatenates, per decoder layer, the weights of `q_proj`,
`k_proj`, `v_proj` (and `gate_proj`, `up_proj`) into one tensor and makes each original weight (and
bias) a view of its rows, so parameter names, the state dict and in-place refits stay as they were
(a refit that writes `q_proj.weight` writes the fused tensor). The first projection of a group to
run computes the whole group with one `F.linear` and keeps the other outputs for the next calls on
the same input; a call on any other input (another model's order of calls) computes its own rows,
so the result is always the plain projection of its input.
"""

import torch
import torch.nn.functional as F
from torch import Tensor, nn

GROUPS = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj")))


class _Group:
    """The fused weight of one group and the outputs waiting for their projection's call."""

    def __init__(self, weight: Tensor, bias: Tensor | None, sizes: list[int]):
        self.weight, self.bias, self.sizes = weight, bias, sizes
        self.input: Tensor | None = None
        self.outputs: dict[int, Tensor] = {}


class FusedLinear(nn.Module):
    """One projection of a fused group: its own weight (a view of the group's) under its usual name."""

    def __init__(self, group: _Group, index: int, weight: Tensor, bias: Tensor | None):
        super().__init__()
        self.group, self.index = group, index
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

    def forward(self, x: Tensor) -> Tensor:
        g = self.group
        if g.input is x and self.index in g.outputs:
            out = g.outputs.pop(self.index)
            if not g.outputs:  # the group is done: hold no tensor between forwards (a compiled step
                g.input = None  # would guard on the last one's shape, a prefill's, and recompile)
            return out
        if self.index != 0:  # not the group's first call on this input: the plain projection
            return F.linear(x, self.weight, self.bias)
        parts = F.linear(x, g.weight, g.bias).split(g.sizes, dim=-1)
        g.input, g.outputs = x, dict(enumerate(parts[1:], start=1))
        return parts[0]


def _fusable(linears: list[nn.Module]) -> bool:
    if not all(type(m) is nn.Linear for m in linears):
        return False
    same = {(m.in_features, m.weight.dtype, m.weight.device, m.bias is None) for m in linears}
    return len(same) == 1


@torch.no_grad()
def fuse_projections(model: nn.Module) -> int:
    """Fuse the projection groups of every layer of `model` in place (an inference model, gradients off);
    returns how many groups were fused. Layers whose projections are not plain bias-compatible linear
    layers of one shape and dtype are left alone."""
    fused = 0
    for layer in model.modules():
        for parent_name, names in GROUPS:
            parent = getattr(layer, parent_name, None)
            if parent is None or not all(isinstance(getattr(parent, n, None), nn.Module) for n in names):
                continue
            linears = [getattr(parent, n) for n in names]
            if not _fusable(linears):
                continue
            weight = torch.cat([m.weight for m in linears])
            bias = None if linears[0].bias is None else torch.cat([m.bias for m in linears])
            sizes = [m.out_features for m in linears]
            group = _Group(weight, bias, sizes)
            offsets = [sum(sizes[:i]) for i in range(len(sizes))]
            for i, (name, size, off) in enumerate(zip(names, sizes, offsets, strict=True)):
                b = None if bias is None else bias[off : off + size]
                setattr(parent, name, FusedLinear(group, i, weight[off : off + size], b))
            fused += 1
    return fused
