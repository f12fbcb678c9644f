"""MoE routers in the trainer: fp32 gates, router replay, aux losses and routing metrics.

Everything is applied to a plain transformers model; no modeling code is forked:

- `swap_routers(model)` changes each router's class in place (`module.__class__ = Replay<Class>`, a
  subclass whose `forward` computes the gate logits in fp32, takes the replayed experts where it has
  them and gathers their weights from its own live softmax, so the router keeps its gradient).
  Parameter names, checkpoints, refits and `output_router_logits` are unchanged.
- `shard_routers(model, mesh)` makes every swapped router its own FSDP unit with fp32 parameters,
  so gate logits come from the fp32 master weights whatever the mixed precision of the blocks.
- `MoeRouting` drives the policy's routers through a step: per micro-batch it sets the engine's
  routing on every router for the forward *and* the backward (activation checkpointing recomputes
  the router), collects the live fp32 logits and the experts used, returns the aux losses and
  accumulates the step's metrics (routing agreement, expert load imbalance, aux losses). Routers see
  the micro-batch's rows flattened (packed rows alike); with context parallelism, this rank's slice of
  them, so the routing is sliced the same way (`ContextParallel.shard`).
"""

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from molt_hpc.actor.attention import attention_setup
from molt_hpc.actor.world import gather_all
from molt_hpc.algorithm import Experience, load_balancing_loss, router_z_loss
from molt_hpc.config import MoltConfig
from molt_hpc.models.moe import Router, find_routers, num_layers, renormalises


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


def shard_routers(model: nn.Module, mesh, offload_policy=None) -> None:
    """Make each swapped router its own FSDP unit with fp32 parameters (call before sharding its block;
    `offload_policy` is the blocks' own).

    Inputs are not cast: the router casts them itself, so its outputs (the top-k weights) keep the
    block's dtype."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy, fully_shard

    fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32, cast_forward_inputs=False)
    for module in model.modules():
        if isinstance(module, ReplayRouter):
            fully_shard(module, mesh=mesh, mp_policy=fp32, offload_policy=offload_policy or OffloadPolicy())


def prepare_routers(model: nn.Module, cfg: MoltConfig, role: str) -> None:
    """Before sharding (on the meta device): the policy's and the reference's routers get the fp32 (replay)
    forward; for the policy, MoE settings its routers cannot honour are refused here, before any weight
    is read (a dense model with router replay, a router family replay does not know)."""
    if role == "policy":
        MoeRouting.for_policy(model, cfg)  # checks and swaps; the trainer's own driver is made after loading
    elif role == "reference":
        swap_routers(model, strict=False)


@dataclass
class _Totals:
    """The step's routing sums on this rank."""

    same: int = 0
    known: int = 0
    tokens: int = 0
    aux: float = 0.0
    z: float = 0.0
    load: Tensor | None = None
    """`[MoE layers, experts]` int64 on the CPU: real tokens sent to each expert."""


class MoeRouting:
    """The policy's routers through a training step (one per policy model)."""

    def __init__(self, model: nn.Module, *, replay: bool, aux_coef: float, z_coef: float):
        routers = swap_routers(model)
        if not routers:
            raise ValueError(f"{type(model).__name__} has no MoE router")
        self.model = model
        self.slots = [r.module.molt_slot for r in routers]
        self.layers = num_layers(model)
        self.top_k = int(routers[0].module.top_k)
        self.num_experts = int(routers[0].module.num_experts)
        self.replay, self.aux_coef, self.z_coef = replay, aux_coef, z_coef
        self.totals = _Totals()

    @classmethod
    def for_policy(cls, model: nn.Module, cfg: MoltConfig) -> "MoeRouting | None":
        """The policy's routing driver, or None for a dense model (an error if MoE settings ask for one)
        and for a router family replay does not know when nothing asks for it (it then trains as
        transformers runs it)."""
        alg, act = cfg.algorithm, cfg.actor
        asked = [
            name
            for name, on in (
                ("actor.router_replay", act.router_replay),
                ("algorithm.moe_aux_coef", alg.moe_aux_coef),
                ("algorithm.moe_z_coef", alg.moe_z_coef),
            )
            if on
        ]
        if not find_routers(model):
            if asked:
                raise ValueError(f"{', '.join(asked)} set but {type(model).__name__} has no MoE router: unset them")
            return None
        if not swap_routers(model, strict=bool(asked)):
            return None
        return cls(model, replay=act.router_replay, aux_coef=alg.moe_aux_coef, z_coef=alg.moe_z_coef)

    def _engine_rows(self, mb: Experience) -> Tensor | None:
        routed = mb.routed_experts
        if routed is None:
            return None
        if tuple(routed.shape[2:]) != (self.layers, self.top_k):
            raise ValueError(
                f"the engines' routed experts are [layers, top_k] = {list(routed.shape[2:])} but the policy has "
                f"{self.layers} layers and top-{self.top_k}: the engines must serve the trained model"
            )
        if routed.numel() and int(routed.max()) >= self.num_experts:
            raise ValueError(f"an engine routed to expert {int(routed.max())}; the policy has {self.num_experts}")
        return routed

    @contextlib.contextmanager
    def micro_batch(self, mb: Experience):
        """Route one micro-batch: with replay, the engine's experts where known and live elsewhere (without,
        live, compared with the engine's where it has them); covers the forward and the backward. Call
        `aux_loss` between the two."""
        routed, mask = self._engine_rows(mb), mb.attention_mask
        setup = attention_setup(self.model)
        cp = setup.cp if setup is not None else None
        if cp is not None:  # with context parallelism the routers see this rank's slice of every row
            routed = None if routed is None else cp.shard(routed, -1)
            mask = cp.shard(mask, False)
        mask = mask.reshape(-1)
        try:
            for slot in self.slots:
                if routed is not None:
                    slot.engine = routed[:, :, slot.layer].reshape(-1, self.top_k).long()
                slot.replay, slot.mask, slot.collecting = self.replay, mask, True
            yield self
        finally:
            for slot in self.slots:
                slot.clear()

    def aux_loss(self, weight: float) -> Tensor:
        """End the micro-batch's forward: `(moe_aux_coef · load balance + moe_z_coef · z-loss) × weight`
        from the live fp32 router logits (the experts actually used count as selected), and record the
        micro-batch's metrics. `weight` is its share of the mini-batch's action tokens (0: a padding
        micro-batch, which records nothing)."""
        for slot in self.slots:
            slot.collecting = False
        first = self.slots[0]
        assert first.logits is not None, "aux_loss() is called after the micro-batch's forward"
        if weight == 0:
            return first.logits.new_zeros(())
        trained = bool(self.aux_coef or self.z_coef)
        logits = [s.logits if trained else s.logits.detach() for s in self.slots]
        chosen = [s.chosen for s in self.slots]
        mask = first.mask
        aux = load_balancing_loss(logits, self.top_k, mask, chosen)
        z = router_z_loss(logits, mask)
        self._record(aux.detach(), z.detach(), chosen, mask)
        if not trained:
            return first.logits.new_zeros(())
        return (self.aux_coef * aux + self.z_coef * z) * weight

    def _record(self, aux: Tensor, z: Tensor, chosen: list[Tensor], mask: Tensor) -> None:
        t = self.totals
        n = int(mask.sum())
        t.tokens += n
        t.aux += float(aux) * n
        t.z += float(z) * n
        load = torch.stack([torch.bincount(c[mask].reshape(-1), minlength=self.num_experts) for c in chosen]).cpu()
        t.load = load if t.load is None else t.load + load
        if self.slots[0].known is not None:
            t.same += sum(int(s.same) for s in self.slots)
            t.known += sum(int(s.known) for s in self.slots)

    def step_metrics(self, exp: Experience) -> dict[str, float]:
        """The step's routing metrics, the same on every rank (a collective); starts the next step's sums."""
        parts = gather_all(self.totals)
        self.totals = _Totals()
        tokens = sum(p.tokens for p in parts)
        out: dict[str, float] = {}
        if tokens:
            out["moe_aux_loss"] = sum(p.aux for p in parts) / tokens
            out["moe_z_loss"] = sum(p.z for p in parts) / tokens
            load = sum(p.load for p in parts if p.load is not None).double()  # [layers, experts]
            out["moe_load_imbalance"] = float((load.max(1).values / load.mean(1)).mean())
        known = sum(p.known for p in parts)
        if known:
            out["routing_agreement"] = sum(p.same for p in parts) / known
        if self.replay:
            out["replayed_tokens"] = known / len(self.slots)
            unrouted = exp.num_samples if exp.routed_experts is None else exp.stats.get("unrouted_samples", 0)
            out["unreplayed_samples"] = unrouted
        return out
