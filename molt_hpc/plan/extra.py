"""What an extra engine pool (`molt-hpc engines add`) adds to a planned run: each engine's GPU memory and KV
capacity (the same engine settings as the run's own, unless the pool overrides them), the bytes every refit
sends it, and the time those take over the network (an extra pool runs in its own Slurm job, on other nodes)."""

from molt_hpc.plan.render import gib
from molt_hpc.plan.verdict import Plan


def extra_pool_lines(plan: Plan, count: int) -> list[str]:
    """The report's lines for `count` more engines in an extra pool."""
    e, r, cfg = plan.engines, plan.refit, plan.cfg
    send_s = r.bytes / (cfg.plan.network_gb_per_s * 1e9)
    base, per = e.engines, "GPU" if plan.placement.engine_device == "cuda" else "engine"
    lines = [
        f"extra pool of {count} engine(s) ({e.kind}, molt-hpc engines add), per engine:",
        f"  GPUs                               {e.gpus_per_engine if per == 'GPU' else 0:>14}",
        f"  memory per {per:<23} {gib(e.used):>14}  (weights {gib(e.weights)}, KV cache {gib(e.kv_cache)})",
        f"  KV cache                           {e.kv_tokens:>14,} tokens ({e.full_sequences:,} sequences of "
        f"{e.max_model_len:,})",
        f"  each refit sends it                {gib(r.bytes):>14}  ≈ {send_s * 1e3:,.1f} ms at "
        f"plan.network_gb_per_s = {cfg.plan.network_gb_per_s:g} (it serves after its first refit)",
        f"  rollout capacity                   {base} -> {base + count} engines: at most "
        f"{(base + count) / base:,.2f}x the run's engine throughput (fewer when the trainer bounds the step)",
    ]
    return lines
