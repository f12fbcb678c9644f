"""`molt-hpc plan --balance`: the engine:trainer GPU split and `rollout.groups_in_flight` that train the
most tokens per second on the config's GPUs, by the speed prediction (`plan/speed.py`).

Candidates keep the GPUs the config asks for: on Slurm whole nodes move between the actor and engine
het groups when their nodes have as many GPUs (each group keeps at least one node; an engine spanning
`nodes_per_engine` nodes moves in steps of that many); on one machine GPUs move between `actor.ranks`
and `engines.count` (each engine keeps its `gpus_per_engine`). Each split is tried with a few
`groups_in_flight` values (one to four steps' worth of groups, and the config's own). A candidate
counts when the config tree accepts it and its memory plan fits with nothing blocking (FSDP, CP and
EP divisibility, engine TP).
"""

from dataclasses import dataclass

from molt_hpc.config import MoltConfig
from molt_hpc.plan.arch import Arch, arch_of
from molt_hpc.plan.speed import Speed, predict
from molt_hpc.plan.suggest import with_changes
from molt_hpc.plan.verdict import Plan, make_plan


@dataclass
class Candidate:
    changes: list[str]
    plan: Plan
    speed: Speed


def splits(cfg: MoltConfig, local: bool) -> list[list[str]]:
    """Every engine:trainer split of the config's GPUs, as overrides (the config's own included: [])."""
    eng, sl = cfg.engines, cfg.slurm
    out: list[list[str]] = [[]]
    if not local and sl.actor.gpus_per_node and sl.actor.gpus_per_node == sl.engines.gpus_per_node:
        nodes, step = sl.actor.nodes + sl.engines.nodes, eng.nodes_per_engine
        for engine_nodes in range(step, nodes, step):
            if engine_nodes == sl.engines.nodes:
                continue
            change = [f"slurm.actor.nodes={nodes - engine_nodes}", f"slurm.engines.nodes={engine_nodes}"]
            out.append(change + ([f"engines.count={engine_nodes // step}"] if step > 1 else []))
    elif local and cfg.actor.device == "cuda" and eng.device == "cuda":
        per = eng.gpus_per_engine
        gpus = cfg.actor.ranks + eng.count * per
        for count in range(1, gpus // per + 1):
            ranks = gpus - count * per
            if ranks >= 1 and count != eng.count:
                out.append([f"actor.ranks={ranks}", f"engines.count={count}"])
    return out


def in_flight_values(cfg: MoltConfig) -> list[int]:
    g = cfg.actor.groups_per_step
    return sorted({cfg.rollout.groups_in_flight, g, 2 * g, 4 * g})


def candidates(cfg: MoltConfig, arch: Arch, local: bool) -> list[Candidate]:
    """Every accepted, fitting candidate, the most trained tokens per second first."""
    out = []
    for split in splits(cfg, local):
        for gif in in_flight_values(cfg):
            changes = split + ([f"rollout.groups_in_flight={gif}"] if gif != cfg.rollout.groups_in_flight else [])
            new = with_changes(cfg, changes) if changes else cfg
            if new is None:
                continue
            plan = make_plan(new, arch, local=local, gpus=_gpus(new) if local else None)
            if plan.runnable:
                out.append(Candidate(changes, plan, predict(plan)))
    out.sort(key=lambda c: (-c.speed.trained_tokens_per_s, len(c.changes)))
    return out


def _gpus(cfg: MoltConfig) -> int:
    """GPUs of a local candidate: exactly what it asks for (the split keeps the total)."""
    return cfg.actor.ranks + cfg.engines.count * cfg.engines.gpus_per_engine


def apply_best(cfg: MoltConfig, *, local: bool) -> tuple[MoltConfig, list[str]]:
    """`cfg` with the best candidate's overrides, and those overrides. Raises when none fits."""
    found = candidates(cfg, arch_of(cfg.model), local)
    if not found:
        raise ValueError("plan --balance: no engine:trainer split of this config fits; see `molt-hpc plan`")
    best = found[0]
    return (with_changes(cfg, best.changes) if best.changes else cfg), best.changes


def _line(c: Candidate, base: float | None) -> str:
    s, w = c.speed, c.plan.placement
    gain = f" ({100 * (s.trained_tokens_per_s / base - 1):+.0f}% vs the config)" if base and c.changes else ""
    return (f"{' '.join(c.changes) or '(the config as it is)'}\n"
            f"     trainer {w.actor_ranks} GPU(s), engines {w.engines} × {c.plan.engines.gpus_per_engine} GPU(s), "
            f"groups_in_flight {c.plan.cfg.rollout.groups_in_flight}: step {s.step_s:,.2f} s (rollout "
            f"{s.rollout.seconds:,.2f}, train {s.train.seconds:,.2f}, refit {s.refit_s:,.2f}; bound by {s.bound}), "
            f"{s.trained_tokens_per_s:,.0f} trained tokens/s{gain}")  # fmt: skip


def balance_report(cfg: MoltConfig, *, local: bool, top: int = 3) -> str:
    arch = arch_of(cfg.model)
    found = candidates(cfg, arch, local)
    if not found:
        return "balance: no engine:trainer split of this config fits (see `molt-hpc plan`)"
    own = next((c for c in found if not c.changes), None)
    base = own.speed.trained_tokens_per_s if own else None
    lines = [f"balance: {len(found)} fitting candidate(s); the best {min(top, len(found))} by trained tokens/s:"]
    lines += [f"  {i}. {_line(c, base)}" for i, c in enumerate(found[:top], 1)]
    if own is not None and own not in found[:top]:
        lines.append(f"  config: {_line(own, None)}")
    if found[0].changes:
        lines.append(
            f"apply the best: molt-hpc submit CONFIG --balance (or {' '.join('--set ' + c for c in found[0].changes)})"
        )
    return "\n".join(lines)
