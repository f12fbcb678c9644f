"""MoE routers in the trainer: fp32 gates, router replay, aux losses and routing metrics.

Everything is applied to a plain transformers model; no modeling code is forked:

- `swap_routers(model)` (`molt_hpc.models.router_replay`) gives each router the fp32 replay forward;
  `molt_hpc.parallel` makes every swapped router its own FSDP unit with fp32 parameters, so gate logits
  come from the fp32 master weights whatever the mixed precision of the blocks.
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
from torch import Tensor, nn

from molt_hpc.actor.world import gather_all
from molt_hpc.algorithm import Experience, load_balancing_loss, router_z_loss
from molt_hpc.config import MoltConfig
from molt_hpc.models.moe import find_routers, num_layers
from molt_hpc.models.router_replay import swap_routers
from molt_hpc.parallel.attention import attention_setup


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
