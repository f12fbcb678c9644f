"""The plan as text: the full report of `molt-hpc plan`, and the one-line verdict `run`/`submit` print."""

from molt_hpc.plan.engine import GIB
from molt_hpc.plan.suggest import Suggestion
from molt_hpc.plan.verdict import Plan, gpu_need

_COMMANDS = {"sft": "molt-hpc sft", "rm": "molt-hpc rm train"}


def gib(x: float) -> str:
    return f"{x / GIB:,.1f} GiB" if abs(x) >= GIB / 10 else f"{x / 2**20:,.1f} MiB"


def change_text(s: Suggestion, base: Plan) -> str:
    shown = {w: d for w, d in s.effect.items() if abs(d) >= 0.05e9} or s.effect
    effects = ", ".join(f"{'−' if d < 0 else '+'}{abs(d) / 1e9:,.1f} GB {what}" for what, d in shown.items())
    status = "fits" if s.fits else "still does not fit"
    new = [b for b in s.plan.blocker_names if b not in base.blocker_names]
    blocked = f"; needs what is not built yet: {', '.join(new)}" if new else ""
    return f"{' + '.join(s.changes)}: {effects} ({status}{blocked})"


def verdict_line(plan: Plan, suggestions: list[Suggestion] = ()) -> str:
    """One line: fits or not (by how much, and the cheapest fix), and what blocks a run."""
    parts = []
    for c in plan.checks:
        if not c.ok:
            parts.append(f"{c.what} needs {gib(c.need)} of {gib(c.limit)}")
    if not plan.fits:
        fix = next((s for s in suggestions if s.fits), None)
        hint = f"; try {' + '.join(fix.changes)}" if fix else ""
        text = "does not fit: " + "; ".join(parts) + hint
    else:
        text = "fits: " + ", ".join(f"{c.what} {gib(c.need)} of {gib(c.limit)}" for c in plan.checks)
    if plan.blockers:
        text += " — cannot run yet: " + "; ".join(plan.blocker_names)
    return f"plan: {text} (details: molt-hpc plan)"


def report(plan: Plan, suggestions: list[Suggestion]) -> str:
    a, w, cfg = plan.arch, plan.placement, plan.cfg
    rl = cfg.run.stage == "rl"
    moe = f", MoE {a.experts} experts top-{a.top_k} ({a.expert_params / 1e9:.1f}B in experts)" if a.is_moe else ""
    lines = [
        f"model: {a.model_type}, {a.params / 1e9:.2f}B parameters, {a.layers} layers, hidden {a.hidden}, "
        f"vocab {a.vocab}{moe} (from {a.source})",
        f"placement ({w.mode}): actor pool {w.actor_ranks} {w.actor_device.upper()} rank(s) on {w.actor_nodes} "
        f"node(s) (cp {cfg.actor.cp}, ep {cfg.actor.ep}, offload {cfg.actor.offload}); "
        + (
            f"engine pool {w.engines} {cfg.engines.kind} engine(s) × {plan.engines.gpus_per_engine} "
            f"{w.engine_device.upper()}"
            if rl
            else f"no engines (`{_COMMANDS[cfg.run.stage]}` trains alone)"
        )
        + (" — sharing the trainer's GPU" if w.shared_gpu else ""),
        "",
        f"trainer, per {'GPU' if w.actor_device == 'cuda' else 'rank'}:",
    ]
    t = plan.trainer
    for key, value in t.state.items():
        lines.append(f"  {key:<34} {gib(value):>14}")
    for key, value in t.activations.items():
        lines.append(f"  {key:<34} {gib(value):>14}  (one micro-batch, {_tokens(plan)} tokens)")
    lines.append("  phases (allocated):")
    peak = plan.trainer_peak
    for phase in [*t.phases, plan.refit_phase]:
        mark = "  ← peak" if phase is peak else ""
        lines.append(f"    {phase.name:<32} {gib(phase.total):>14}{mark}")
    lines.append(f"  peak {peak.name}: {gib(peak.total)} allocated → {gib(gpu_need(peak.total))} with the CUDA "
                 "context and allocator slack")  # fmt: skip
    lines += ["", *(_engine_lines(plan) if rl else []), *([""] if rl else []), *_refit_host_lines(plan), "",
              *_scorer_lines(plan), *_teacher_lines(plan), *(_speed_block(plan) if rl else []), "verdict:"]  # fmt: skip
    for c in plan.checks:
        lines.append(f"  {'ok  ' if c.ok else 'FAIL'} {c.what:<30} {gib(c.need):>14} of {gib(c.limit)}")
    for b in plan.blockers:
        lines.append(f"  BLOCKED {b}")
    lines.append(
        "  " + verdict_line(plan, suggestions).removeprefix("plan: ").removesuffix(" (details: molt-hpc plan)")
    )
    if suggestions:
        lines += ["", "changes that would help (cheapest first):"]
        lines += [f"  {i}. {change_text(s, plan)}" for i, s in enumerate(suggestions, 1)]
    return "\n".join(lines)


def _speed_block(plan: Plan) -> list[str]:
    from molt_hpc.plan.speed import predict
    from molt_hpc.plan.speed_text import speed_lines

    w = plan.placement
    return [*speed_lines(predict(plan), (w.actor_device, w.engine_device)), ""]


def _tokens(plan: Plan) -> int:
    from molt_hpc.plan.shape import shape_of

    return shape_of(plan.cfg, plan.placement.actor_ranks, plan.placement.actor_device, plan.arch).tokens


def _engine_lines(plan: Plan) -> list[str]:
    e = plan.engines
    per = "GPU" if plan.placement.engine_device == "cuda" else "engine"
    lines = [f"engines ({e.kind}), per {per}:", f"  weights{'' if e.gpus_per_engine == 1 else ' per GPU':<27} "
             f"{gib(e.weights):>14}", f"  profile, graphs, sampling          {gib(e.other):>14}",
             f"  KV cache                           {gib(e.kv_cache):>14}  = {e.kv_tokens:,} tokens "
             f"({e.kv_bytes_per_token:,} B/token)"]  # fmt: skip
    need = e.wanted_sequences * e.max_model_len
    each = "engine" if e.replicas == 1 else f"replica ({e.replicas} replicas per engine)"
    lines.append(f"  holds {e.full_sequences:,} sequences of max_model_len {e.max_model_len:,} at once; the rollout "
                 f"keeps {e.wanted_sequences:,} per {each} in flight ({need:,} tokens at full length)")  # fmt: skip
    if e.kv_tokens < need:
        lines.append(
            "  (engines will queue or preempt sequences at full length: more engines, or fewer groups in flight)"
        )
    return lines


def _refit_host_lines(plan: Plan) -> list[str]:
    r = plan.refit
    if plan.cfg.run.stage != "rl":
        return ["host memory per actor node:", *(f"  {k:<34} {gib(v):>14}" for k, v in plan.host.items())]
    if r.copy_s:
        first = (f"refit: {r.bytes / 1e9:,.1f} GB read in place by the engines on the trainer's GPU; "
                 f"≈ {r.copy_s * 1e3:,.1f} ms (a copy at memory bandwidth)")  # fmt: skip
    else:
        first = (f"refit: {r.bytes / 1e9:,.1f} GB in {r.buckets} bucket(s) of {plan.cfg.refit.bucket_mb} MiB; "
                 f"≈ {r.seconds:,.1f} s bound by the links (gather {r.gather_s:,.1f} s + send {r.send_s:,.1f} s"
                 + (f" + LoRA merge {r.merge_s:,.1f} s)" if r.merge_s else ")"))  # fmt: skip
    lines = [first, "host memory per actor node:"]
    lines += [f"  {k:<34} {gib(v):>14}" for k, v in plan.host.items()]
    return lines


def _scorer_lines(plan: Plan) -> list[str]:
    rm = plan.cfg.reward_model
    if rm is None or plan.cfg.run.stage != "rl":
        return []
    gpu = "" if rm.device == "cpu" else (
        f"; a vLLM scorer takes reward_model.gpu_memory_utilization = {rm.gpu_memory_utilization} of its GPU"
        if rm.kind == "vllm" else "; a builtin scorer holds the reward model's weights and one forward of "
        f"reward_model.max_batch = {rm.max_batch} sequences")  # fmt: skip
    return [f"reward-model scorers: {rm.count} {rm.kind} on {rm.device}, not counted in this plan (each takes the "
            f"engine pool's first GPU after the engines', or shares the last one{gpu})", ""]  # fmt: skip


def _teacher_lines(plan: Plan) -> list[str]:
    dist = plan.cfg.distill
    if dist is None or plan.cfg.run.stage != "rl":
        return []
    gpu = "" if dist.device == "cpu" else f"; each holds the teacher and one forward of {dist.max_batch} sequences"
    if dist.device != "cpu" and dist.kind == "vllm":
        gpu = f"; a vLLM teacher takes distill.gpu_memory_utilization = {dist.gpu_memory_utilization} of its GPU"
    where = "the engine pool's first GPU after the engines' and the scorers', or shares the last one"
    return [f"distillation teachers: {dist.count} {dist.kind} on {dist.device}, not counted in this plan (each "
            f"takes {where}{gpu})", ""]  # fmt: skip
