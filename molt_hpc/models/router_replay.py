"""The fp32 replay forward a MoE router gets in the trainer: `swap_routers(model)` changes each router's
class in place (`module.__class__ = Replay<Class>`, a subclass whose `forward` computes the gate logits in
fp32, takes the replayed experts where it has them and gathers their weights from its own live softmax,
so the router keeps its gradient). Parameter names, checkpoints, refits and `output_router_logits` are
unchanged. Each swapped router carries a `RouterSlot`: what the trainer's `MoeRouting` sets and reads.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from molt_hpc.models.moe import Router, find_routers, renormalises


@dataclass(eq=False)
class RouterSlot:
    """One router's state during a micro-batch (outside one, it routes live and records nothing)."""

    layer: int
    renormalise: bool
    engine: Tensor | None = None
    """`[tokens, top_k]` long: the engine's experts (-1 in a row: unknown), compared with the live top-k."""
    replay: bool = False
    """Route the tokens `engine` knows to the engine's experts (else it is only compared)."""
    mask: Tensor | None = None
    """`[tokens]` bool: real tokens (not padding), the ones counted and in the aux losses."""
    collecting: bool = False
    """True during the micro-batch's first forward only (not during a backward recompute)."""
    logits: Tensor | None = None
    chosen: Tensor | None = None
    same: Tensor | None = None
    """Count of real tokens with engine routing whose live top-k set equals the engine's."""
    known: Tensor | None = None
    """Count of real tokens with engine routing."""

    def record(self, logits: Tensor, chosen: Tensor, live: Tensor, known: Tensor | None) -> None:
        self.logits, self.chosen = logits, chosen
        if known is not None:
            assert self.engine is not None and self.mask is not None
            known = known & self.mask
            equal = (live.sort(-1).values == self.engine.sort(-1).values).all(-1)
            self.same, self.known = (equal & known).sum(), known.sum()

    def clear(self) -> None:
        self.engine = self.mask = self.logits = self.chosen = self.same = self.known = None
        self.replay = self.collecting = False


class ReplayRouter:
    """The forward every swapped router runs (a mixin placed before the router's own class)."""

    molt_slot: RouterSlot

    def forward(self, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        slot = self.molt_slot
        h = hidden_states.reshape(-1, self.hidden_dim)
        if getattr(self, "molt_exact", False):  # engines.exact (models/exact_moe.py): batch-invariant gate logits
            from molt_hpc.models.exact_linear import exact_linear

            logits = exact_linear(h.float(), self.weight.float())
        else:
            logits = F.linear(h.float(), self.weight.float())  # fp32 whatever the block computes in
        probs = torch.softmax(logits, dim=-1)
        live = probs.topk(self.top_k, dim=-1).indices
        chosen, known = live, None
        if slot.engine is not None:
            assert slot.engine.shape == live.shape, (
                f"router of layer {slot.layer} sees {live.shape[0]} tokens but was given routing for "
                f"{slot.engine.shape[0]}: shard routed_experts exactly like the tokens"
            )
            known = (slot.engine >= 0).all(-1)
            if slot.replay:
                chosen = torch.where(known[:, None], slot.engine, live)
        weights = probs.gather(-1, chosen)
        if slot.renormalise:
            weights = weights / weights.sum(-1, keepdim=True)
        if slot.collecting:
            slot.record(logits, chosen, live, known)
        return logits, weights.to(hidden_states.dtype), chosen


_CLASSES: dict[type, type] = {}


def _replay_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Replay{cls.__name__}", (ReplayRouter, cls), {"__module__": __name__})
    return _CLASSES[cls]


def swap_routers(model: nn.Module, *, strict: bool = True) -> list[Router]:
    """Give every router of `model` the fp32 replay forward (in place); returns the routers swapped.

    A router whose rule is not softmax -> top-k is a `ValueError` when `strict`, else left as it is
    (and nothing is swapped)."""
    routers = find_routers(model)
    try:
        rules = [renormalises(r.module) for r in routers]
    except ValueError:
        if strict:
            raise
        return []
    for r, renormalise in zip(routers, rules, strict=True):
        if not isinstance(r.module, ReplayRouter):
            r.module.__class__ = _replay_class(type(r.module))
        r.module.molt_slot = RouterSlot(r.layer, renormalise)
    return routers
