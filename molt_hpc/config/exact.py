"""The config rules of `engines.exact`: what batch-invariant log-probs can be computed for, and what not."""


def exact_problem(cfg) -> str | None:
    """Why `cfg` (a `MoltConfig` with `engines.exact`) cannot run exactly, with the fix; None when it can."""
    eng, act, ro = cfg.engines, cfg.actor, cfg.rollout
    if eng.kind != "builtin":
        return (
            f"engines.exact needs the builtin engine (engines.kind = {eng.kind!r} computes log-probs with its own "
            "kernels): set engines.kind = 'builtin' or engines.exact = false"
        )
    if eng.device == "auto" or eng.device != act.device:
        return (
            "engines.exact needs the engine and the trainer on one named kind of device (the same ops give the "
            "same bits there): set engines.device and actor.device both to 'cpu' or both to 'cuda' (GPUs of one "
            "type, with triton), or engines.exact = false"
        )
    if ro.top_p < 1.0 or ro.top_k > 0:
        return "engines.exact matches the temperature-only distribution: set rollout.top_p = 1 and rollout.top_k = 0"
    if act.lora is not None and act.lora.engine_weights != "separate":
        return (
            "engines.exact with [actor.lora] needs the engine to compute the adapters as the trainer does (merged "
            "weights are other numbers): set actor.lora.engine_weights = 'separate', or engines.exact = false"
        )
    if act.lora is not None and any(t.split(".")[-1] == "lm_head" for t in act.lora.target_modules or []):
        return (
            "engines.exact computes the LM head as one exact multiply of its weight, which an adapted head is not: "
            "drop lm_head from actor.lora.target_modules, or set engines.exact = false"
        )
    if act.cp > 1:
        return "engines.exact attends one packed sample at a time on one rank: set actor.cp = 1"
    return None
