"""Changes that would make a config fit, each re-planned to give its predicted effect, cheapest first.

Each candidate is one `--set` override the user could make. It is applied to the config, the config
is validated again (a change the config tree refuses is no suggestion) and planned again with the
same model counts, so every effect is the planner's own number, never a rule of thumb. Candidates
are ranked: those that make the plan fit come first, each group in order of cost (compute spent or
GPUs added), and where no single change is enough a combination is built greedily.
"""

from dataclasses import dataclass

from molt_hpc.config import MoltConfig
from molt_hpc.config.load import apply_override
from molt_hpc.net import LOOPBACK
from molt_hpc.plan.arch import Arch
from molt_hpc.plan.verdict import Plan, make_plan

COST = {
    "actor.logprob_chunk": 0,
    "engines.gpu_memory_utilization": 0,
    "actor.activation_checkpointing": 1,
    "actor.micro_batch_size": 1,
    "actor.cp": 2,
    "actor.ep": 2,
    "engines.tensor_parallel": 2,
    "engines.nodes_per_engine": 2,
    "actor.offload": 3,
    "actor.lora.rank": 3,
    "slurm.actor.nodes": 4,
    "slurm.engines.nodes": 4,
    "actor.offload='full'": 5,
}
"""Rank of each kind of change: free, some recompute, more communication, host round trips (the
optimizer's moments) or low-rank adapters instead of every weight (LoRA trains another model), more
GPUs, and last the whole state on the host (the optimizer steps on the CPU)."""
LORA_RANKS = (128, 64, 32, 16, 8)
"""Adapter ranks tried, largest first, when a full fine-tune does not fit: the largest that fits is suggested."""


@dataclass
class Suggestion:
    changes: list[str]
    plan: Plan
    effect: dict[str, float]
    """Check name → change of its need in bytes (negative: less)."""

    @property
    def fits(self) -> bool:
        return self.plan.fits

    @property
    def cost(self) -> int:
        return max(COST.get(c, COST.get(c.partition("=")[0], 5)) for c in self.changes)


def candidates(cfg: MoltConfig, arch: Arch) -> list[str]:
    act, eng, sl = cfg.actor, cfg.engines, cfg.slurm
    out = []
    if act.logprob_chunk > 256:
        out.append(f"actor.logprob_chunk={act.logprob_chunk // 2}")
    if not act.activation_checkpointing:
        out.append("actor.activation_checkpointing=true")
    if act.micro_batch_size > 1:
        out.append(f"actor.micro_batch_size={act.micro_batch_size // 2}")
    if arch.heads % (2 * act.cp) == 0:
        out.append(f"actor.cp={2 * act.cp}")
    if arch.is_moe and act.ep == 1:
        out += [f"actor.ep={ep}" for ep in (8, 4, 2) if arch.experts % ep == 0][:1]
    out += [f"actor.offload='{mode}'" for mode in ("optimizer", "full") if act.offload != mode]
    if sl.actor.gpus_per_node:
        out.append(f"slurm.actor.nodes={2 * sl.actor.nodes}")
    if eng.kind == "vllm":
        if eng.gpu_memory_utilization < 0.92:
            out.append("engines.gpu_memory_utilization=0.92")
        out.append(f"engines.tensor_parallel={2 * eng.tensor_parallel}")
    if sl.engines.gpus_per_node:
        out.append(f"slurm.engines.nodes={2 * sl.engines.nodes}")
    return out


def span_candidate(cfg: MoltConfig, arch: Arch) -> list[str]:
    """A vLLM MoE engine that fills its nodes: twice the nodes per engine, the experts over all of them
    (as many engine GPUs as before, in half as many engines); [] when it does not apply."""
    eng, group = cfg.engines, cfg.slurm.engines
    fills = bool(group.gpus_per_node) and eng.gpus_per_engine_node >= group.gpus_per_node
    if eng.kind != "vllm" or not arch.is_moe or not fills:
        return []
    nodes = 2 * eng.nodes_per_engine
    count = max(1, group.nodes // nodes)
    out = [f"engines.nodes_per_engine={nodes}", f"engines.data_parallel={2 * eng.data_parallel}"]
    out += ["engines.expert_parallel=true", f"engines.count={count}", f"slurm.engines.nodes={count * nodes}"]
    return out + (["engines.host='0.0.0.0'"] if eng.host in LOOPBACK else [])


def with_changes(cfg: MoltConfig, changes: list[str]) -> MoltConfig | None:
    """`cfg` with `key=value` overrides, or None when the config tree refuses the result."""
    data = cfg.model_dump(exclude_none=True)
    for change in changes:
        apply_override(data, change)
    try:
        return MoltConfig.model_validate(data)
    except ValueError:  # pydantic's ValidationError: this change breaks a rule of the config
        return None


def suggest(plan: Plan, *, local: bool = False, gpus: int | None = None, limit: int = 6) -> list[Suggestion]:
    """Ranked changes that lower the needs of `plan`'s failing checks (empty when it fits)."""
    if plan.fits:
        return []
    failing = [c.what for c in plan.checks if not c.ok]
    found = []
    for changes in [*([c] for c in candidates(plan.cfg, plan.arch)), span_candidate(plan.cfg, plan.arch)]:
        s = _evaluate(plan, changes, failing, local, gpus) if changes else None
        if s is not None:
            found.append(s)
    lora = _lora(plan, failing, local, gpus)
    if lora is not None:
        found.append(lora)
    cheapest_fit = min((s.cost for s in found if s.fits), default=None)
    if found and (cheapest_fit is None or cheapest_fit > 2):  # a combination of cheaper changes may do
        combo = _combine(plan, found, failing, local, gpus)
        if combo is not None and combo.fits and (cheapest_fit is None or combo.cost < cheapest_fit):
            found.append(combo)
    found.sort(key=lambda s: (not s.fits, s.cost, len(s.changes), min(s.effect.values())))
    return found[:limit]


def _evaluate(plan: Plan, changes: list[str], failing: list[str], local: bool, gpus: int | None) -> Suggestion | None:
    cfg = with_changes(plan.cfg, changes)
    if cfg is None:
        return None
    after = make_plan(cfg, plan.arch, local=local, gpus=gpus)
    effect = {w: after.check(w).need - plan.check(w).need for w in failing}
    if not any(d < 0 for d in effect.values()):
        return None
    return Suggestion(changes, after, effect)


def _lora(plan: Plan, failing: list[str], local: bool, gpus: int | None) -> Suggestion | None:
    """LoRA for a full RL fine-tune: the largest rank of `LORA_RANKS` that fits, else the smallest that helps."""
    cfg = plan.cfg
    if cfg.actor.lora is not None or cfg.run.stage != "rl":
        return None
    helpful = None
    for rank in LORA_RANKS:
        s = _evaluate(plan, [f"actor.lora.rank={rank}"], failing, local, gpus)
        if s is not None and s.fits:
            return s
        helpful = s or helpful
    return helpful


def _combine(plan: Plan, singles: list[Suggestion], failing: list[str], local: bool, gpus: int | None):
    """Greedy: take the cheapest helpful change, then the next that still helps, until it fits (≤ 4)."""
    chosen: list[str] = []
    best = None
    for s in sorted(singles, key=lambda s: (s.cost, min(s.effect.values()))):
        key = s.changes[0].partition("=")[0]
        if any(c.startswith(key + "=") for c in chosen):
            continue
        trial = _evaluate(plan, [*chosen, *s.changes], failing, local, gpus)
        if trial is None or (best is not None and sum(trial.effect.values()) >= sum(best.effect.values())):
            continue
        chosen, best = [*chosen, *s.changes], trial
        if trial.fits or len(chosen) == 4:
            break
    return best if best is not None and len(best.changes) > 1 else None
