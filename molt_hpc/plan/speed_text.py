"""The speed block of `molt-hpc plan`, and predicted against measured for `molt-hpc status`.

The measured side comes from the run's `metrics.jsonl` (`molt_hpc.plan.step_split`): the trainer's wait
for rollouts, its step and its refit per step, the rollout's generated tokens per second. The
prediction for a run uses the lengths the run measured (the trained tokens per step, the mean response
length) and the fraction of finished groups it accepted (dynamic sampling), so a difference is the
speed model's, not a guess of lengths.
"""

import statistics
from pathlib import Path

from molt_hpc.config import MoltConfig
from molt_hpc.plan.speed import Speed


def _s(x: float) -> str:
    return f"{x * 1e3:,.0f} ms" if x < 1 else f"{x:,.2f} s"


def _flop(x: float) -> str:
    return f"{x / 1e12:,.1f} TFLOP" if x >= 1e12 else f"{x / 1e9:,.2f} GFLOP"


def speed_lines(s: Speed, profile_names: tuple[str, str]) -> list[str]:
    """The plan's speed block: per step, each part, the bound and the throughputs."""
    r, t, w = s.rollout, s.train, s.workload
    mode = "overlapped (async)" if s.overlap else "in sequence"
    if s.shared is not None and s.shared[0] > 0:
        mode = (f"sharing one device (async: the engine at {s.shared[0]:.0%} of its speed beside the training, "
                f"the training {s.shared[1]:.2f}x beside the decoding)")  # fmt: skip
    return [
        f"speed per step ({w.samples} samples of {w.prompt:,.0f} prompt + {w.response:,.0f} response tokens, "
        f"engines on plan.{profile_names[1]}, trainer on plan.{profile_names[0]}):",
        f"  rollout   {_s(r.seconds):>12}  decode {_s(r.decode_s)} ({r.rows} rows per replica, "
        f"{r.decode_step_s * 1e3:,.2f} ms a step, {r.bound}-bound) + prefill {_s(r.prefill_s)}; "
        f"{s.rollout_tokens_per_s:,.0f} tokens/s",
        f"  train     {_s(t.seconds):>12}  {_flop(t.flops)} in {_s(t.compute_s)} + host "
        f"{_s(t.overhead_s)}" + (f" + offload {_s(t.offload_s)}" if t.offload_s else ""),
        f"  refit     {_s(s.refit_s):>12}",
        f"  step      {_s(s.step_s):>12}  rollout and train {mode}; bound by {s.bound}; "
        f"{s.trained_tokens_per_s:,.0f} trained tokens/s",
    ]


def measured(actor: list[dict], rollout: list[dict], skip: int = 2) -> dict[str, float] | None:
    """Mean per-step parts of a run after its first `skip` steps (start-up), or None with too few."""
    from molt_hpc.plan.step_split import split

    kept = actor[skip:] if len(actor) > skip else actor[-1:]
    if not kept:
        return None
    parts = {k: statistics.fmean(v) for k, v in split(kept).items()}
    out = {"wait_s": parts["wait_s"], "train_s": parts["step_s"], "refit_s": parts["refit_s"]}
    out["step_s"] = out["wait_s"] + out["train_s"] + out["refit_s"]
    out["tokens"] = statistics.fmean(float(r.get("tokens") or 0) for r in kept)
    windows = [r for r in rollout[skip:] if r.get("window_s")] or [r for r in rollout if r.get("window_s")]
    if windows:  # generated tokens over the windows' time (a mean of rates would weigh short windows up)
        out["rollout_tokens_per_s"] = sum(r["tokens_per_s"] * r["window_s"] for r in windows) / sum(
            r["window_s"] for r in windows
        )
        lengths = [r["response_len_mean"] for r in windows if r.get("response_len_mean")]
        if lengths:
            out["response"] = statistics.fmean(lengths)
        longest = [r["response_len_max"] for r in windows if r.get("response_len_max")]
        if longest:  # a window's longest response: the tail a group waits for (an upper bound of it)
            out["tail"] = statistics.fmean(longest)
        held = [r for r in windows if r.get("in_flight_mean") is not None]
        if held:  # groups in flight over the windows' time
            out["in_flight"] = sum(r["in_flight_mean"] * r["window_s"] for r in held) / sum(r["window_s"] for r in held)
        finished = sum(r.get("groups_finished", 0) for r in windows)
        if finished:  # dynamic sampling's drops: generated, not trained
            out["accepted"] = max(1e-3, min(1.0, sum(r.get("groups_accepted", 0) for r in windows) / finished))
    return out


def compare_lines(s: Speed, m: dict[str, float]) -> list[str]:
    """Predicted against measured, each with the measured/predicted ratio."""
    rows = [("step", s.step_s, m["step_s"]), ("train", s.train_wall_s, m["train_s"]),
            ("rollout wait", s.wait_s, m["wait_s"]), ("refit", s.refit_s, m["refit_s"])]  # fmt: skip
    out = ["speed (predicted vs measured, per step):"]
    for name, pred, meas in rows:
        ratio = f"{meas / pred:.2f}x" if pred > 1e-6 else "-"
        out.append(f"  {name:<13} {_s(pred):>10} vs {_s(meas):>10}  ({ratio})")
    if "rollout_tokens_per_s" in m:  # the rollout's windows span a step each: generated tokens per step time
        pred, meas = s.delivered_tokens_per_s, m["rollout_tokens_per_s"]
        out.append(f"  rollout       {pred:,.0f} vs {meas:,.0f} tokens/s  ({meas / pred:.2f}x)")
    if "in_flight" in m and s.rollout.groups > 0:  # what admission let the engines hold, on average
        pred, meas = s.rollout.groups, m["in_flight"]
        out.append(f"  in flight     {pred:,.1f} vs {meas:,.1f} groups  ({meas / pred:.2f}x)")
    return out


def ran_where(cfg: MoltConfig, run_dir: Path) -> tuple[bool, int | None]:
    """(local, visible GPUs) of the run: what its local launcher recorded, else (a Slurm run, or a run from
    before the record) local when the config asks Slurm for no GPUs. A config with Slurm GPU counts run on
    one machine shares its GPUs there, and the model must price that (no overlap on a shared GPU)."""
    from molt_hpc.log import read_metrics

    placed = [r for r in read_metrics(run_dir / "metrics.jsonl", source="launcher") if r.get("event") == "placement"]
    if placed:
        return placed[-1]["mode"] == "local", placed[-1].get("gpus")
    return not (cfg.slurm.actor.gpus_per_node or cfg.slurm.engines.gpus_per_node), None


def run_speed_lines(cfg: MoltConfig, actor: list[dict], rollout: list[dict], run_dir: Path) -> list[str]:
    """`molt-hpc status`'s block: the plan's prediction at the run's measured lengths beside the run (the
    model's shape cached in the run directory's `plan_arch.json`)."""
    from molt_hpc.plan.arch import arch_cached
    from molt_hpc.plan.speed import predict
    from molt_hpc.plan.verdict import make_plan

    m = measured(actor, rollout)
    if m is None:
        return []
    samples = cfg.actor.groups_per_step * cfg.rollout.n_samples
    response = m.get("response")
    prompt = max(0.0, m["tokens"] / samples - response) if response is not None and m["tokens"] else None
    local, gpus = ran_where(cfg, run_dir)
    try:
        plan = make_plan(cfg, arch_cached(cfg.model, run_dir / "plan_arch.json"), local=local, gpus=gpus)
    except ValueError as err:  # the model's shape is not readable here: the measured side alone
        return [f"speed: no prediction ({err})"]
    return compare_lines(predict(plan, prompt, response, m.get("accepted", 1.0), m.get("tail")), m)
