"""Batch-invariant mixture-of-experts layers for `engines.exact` (`models/exact.py` applies them).

A plain MoE block is not batch-invariant: each expert multiplies the tokens the router sent it as one
matrix, so a token's result depends on how many other tokens went to the same expert, and the router's
gate logits are a plain matrix multiply too. Here, as functions applied to the plain transformers model:

- every router becomes the trainer's fp32 router (`models.router_replay.swap_routers`: fp32 logits,
  softmax, top-k, the weights gathered from that softmax) with its logits from `exact_linear`, on the
  engine and in the trainer alike, so both route a token the same way from the same weights;
- every experts module of the transformers 5 layout (`gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`,
  `act_fn`) becomes an `ExactExperts`: each expert's two multiplies are `exact_linear`, and the experts'
  weighted outputs are added into each token's row in expert-id order, so a token's sum does not depend
  on which other tokens share its experts.

With router replay the trainer routes each token to the engine's experts; under `exact` its live routing
is the engine's anyway (same bits in, same top-k out), and the replay changes nothing.
"""

import torch
from torch import Tensor, nn

from molt_hpc.models.router_replay import swap_routers

EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")


class ExactExperts(nn.Module):
    """The forward an experts module gets under `exact` (a mixin placed before its own class)."""

    num_experts: int
    gate_up_proj: nn.Parameter
    down_proj: nn.Parameter
    act_fn: nn.Module

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        from molt_hpc.models.exact_linear import exact_linear

        out = torch.zeros_like(hidden_states)
        for e in range(self.num_experts):  # expert-id order: a token's two (k) terms are always added alike
            token, slot = torch.where(top_k_index == e)
            if token.numel() == 0:
                continue
            gate, up = exact_linear(hidden_states[token], self.gate_up_proj[e]).chunk(2, dim=-1)
            h = exact_linear(self.act_fn(gate) * up, self.down_proj[e])
            out.index_add_(0, token, (h * top_k_weights[token, slot, None]).to(out.dtype))
        return out


_CLASSES: dict[type, type] = {}


def _exact_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Exact{cls.__name__}", (ExactExperts, cls), {"__module__": __name__})
    return _CLASSES[cls]


def _experts_modules(model: nn.Module) -> list[nn.Module]:
    """Every module holding stacked expert weights (3-D parameters)."""
    return [m for m in model.modules() if any(p.dim() == 3 for p in m.parameters(recurse=False))]


def make_moe_exact(model: nn.Module) -> set[int]:
    """Switch the routers and experts of `model` to their exact forwards in place; returns the ids of the
    modules changed (their weights are multiplied exactly now). A `ValueError` names what has no exact form."""
    routers = swap_routers(model)  # a router that is not softmax -> top-k is a ValueError here
    experts = _experts_modules(model)
    if not routers or not experts:
        raise ValueError(
            "engines.exact: this mixture-of-experts model's routers or experts were not found in the layout "
            "exact forwards cover (transformers 5 routers and stacked expert weights): set engines.exact = false"
        )
    for module in experts:
        names = {n for n, p in module.named_parameters(recurse=False) if p.dim() == 3}
        if names != set(EXPERT_WEIGHTS) or not hasattr(module, "act_fn") or not hasattr(module, "num_experts"):
            raise ValueError(
                f"engines.exact: {type(module).__name__} keeps its experts as {sorted(names)}, not the "
                f"{' and '.join(EXPERT_WEIGHTS)} layout exact forwards cover: set engines.exact = false for this model"
            )
        if not isinstance(module, ExactExperts):
            module.__class__ = _exact_class(type(module))
    for r in routers:
        r.module.molt_exact = True  # ReplayRouter takes its gate logits from exact_linear
    return {id(m) for m in experts} | {id(r.module) for r in routers}
