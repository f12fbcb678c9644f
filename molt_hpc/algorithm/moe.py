"""MoE auxiliary losses as functions of router logits: Switch load balancing and the router z-loss.

Router logits are `[tokens, experts]` for one layer, or a list of them (one per MoE layer; the
losses average over layers). Take them in fp32 (a train/inference consistency guard). `token_mask`
`[tokens]` leaves padding out; pass the mask of real tokens, not only action tokens, since the
router sees every token.
"""

from collections.abc import Sequence

import torch
from torch import Tensor


def _layers(router_logits: Tensor | Sequence[Tensor]) -> list[Tensor]:
    layers = [router_logits] if isinstance(router_logits, Tensor) else list(router_logits)
    if not layers or any(x.dim() != 2 for x in layers):
        raise ValueError("router_logits must be [tokens, experts] or a non-empty list of them (one per layer)")
    return layers


def load_balancing_loss(
    router_logits: Tensor | Sequence[Tensor],
    top_k: int,
    token_mask: Tensor | None = None,
    selected_experts: Tensor | Sequence[Tensor] | None = None,
) -> Tensor:
    """Switch-Transformer load balancing: `E · Σ_i f_i · P_i`, averaged over layers.

    `f_i` is the fraction of the tokens' `top_k` assignments that went to expert i (so Σ f = 1) and
    `P_i` the mean router probability of expert i; a perfectly balanced router gives 1. The
    gradient flows through `P`. `selected_experts [tokens, top_k]` (per layer) replaces the top-k of
    the logits when the engine's routing is replayed.
    """
    layers = _layers(router_logits)
    chosen = [None] * len(layers) if selected_experts is None else _layers(selected_experts)
    losses = []
    for logits, sel in zip(layers, chosen, strict=True):
        t, e = logits.shape
        mask = torch.ones(t, dtype=torch.bool, device=logits.device) if token_mask is None else token_mask.bool()
        probs = torch.softmax(logits.float(), dim=-1)
        if sel is None:
            sel = probs.topk(top_k, dim=-1).indices
        hits = torch.zeros(t, e, dtype=probs.dtype, device=probs.device).scatter_add_(
            1, sel.long(), torch.ones(sel.shape, dtype=probs.dtype, device=probs.device)
        )
        n = mask.sum().clamp(min=1)
        f = (hits * mask[:, None]).sum(0) / (n * top_k)
        p = (probs * mask[:, None]).sum(0) / n
        losses.append(e * (f * p).sum())
    return torch.stack(losses).mean()


def router_z_loss(router_logits: Tensor | Sequence[Tensor], token_mask: Tensor | None = None) -> Tensor:
    """ST-MoE router z-loss: mean over tokens of `logsumexp(logits)^2`, averaged over layers."""
    losses = []
    for logits in _layers(router_logits):
        z = torch.logsumexp(logits.float(), dim=-1) ** 2
        if token_mask is None:
            losses.append(z.mean())
        else:
            m = token_mask.bool()
            losses.append(torch.where(m, z, torch.zeros_like(z)).sum() / m.sum().clamp(min=1))
    return torch.stack(losses).mean()
