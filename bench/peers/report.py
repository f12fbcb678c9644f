"""The peer benchmark's numbers from each run's own records, one Markdown table and one plot.

molt-hpc: the run's `metrics.jsonl` (`eval` records for pass@k, `rollout` windows for generated tokens, `actor`
steps for trained tokens), times taken against the driver's start of the process. An evaluation is placed at
the time its policy version was published (the actor's record of that step), which is when TRL's clock reads
an evaluation too: at the weights it evaluates. TRL: its `events.jsonl` (`trl_run.py`). Only what happened by
the budget counts; token rates are over the whole budget, start-up included, for both.
"""

import hashlib
import json
import statistics
from pathlib import Path
from typing import Any

from molt_hpc.log import read_metrics


def molt_curve(records: list[dict], t0: float, key: str) -> list[tuple[float, float]]:
    """(seconds since the start, the metric) of each evaluation, at the publication of its version."""
    published = {r["step"]: r["time"] - t0 for r in records if r.get("source") == "actor" and "step" in r}
    rollouts = [r for r in records if r.get("source") == "rollout" and r.get("window_s")]
    first = rollouts[0]["time"] - rollouts[0]["window_s"] - t0 if rollouts else None
    curve = []
    for r in records:
        if r.get("source") != "eval" or r.get(f"eval_{key}") is None:
            continue
        version = r["eval_version"]
        at = published.get(version, first if version == 0 and first is not None else r["time"] - t0)
        curve.append((at, r[f"eval_{key}"]))
    return sorted(curve)


def molt_summary(run_dir: Path, t0: float, budget: float, key: str) -> dict[str, Any]:
    records = read_metrics(run_dir / "metrics.jsonl")
    end = t0 + budget
    actor = [r for r in records if r.get("source") == "actor" and "step" in r and r["time"] <= end]
    rollout = [r for r in records if r.get("source") == "rollout" and r.get("window_s") and r["time"] <= end]
    return {
        "curve": [p for p in molt_curve(records, t0, key) if p[0] <= budget],
        "steps": max((r["step"] for r in actor), default=0),
        "generated": sum(r.get("tokens_per_s", 0.0) * r["window_s"] for r in rollout),
        "trained": sum(r.get("action_tokens", 0) for r in actor),
        "weights": weights_digest(built_model(run_dir / "models")),
    }


def trl_summary(folder: Path, budget: float, key: str) -> dict[str, Any]:
    path = folder / "events.jsonl"  # absent when the run failed before training
    events = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    steps = [e for e in events if e["kind"] == "step" and e["t"] <= budget]
    return {
        "curve": [(e["t"], e[key]) for e in events if e["kind"] == "eval" and e["t"] <= budget],
        "steps": steps[-1]["step"] if steps else 0,
        "generated": steps[-1]["generated"] if steps else 0,
        "trained": steps[-1]["trained"] if steps else 0,
        "notes": [e["text"] for e in events if e["kind"] == "note"],
        "eval_s": sum(e["seconds"] for e in events if e["kind"] == "eval"),
    }


def built_model(cache: Path) -> Path | None:
    """The model directory a run built into its model cache (None for a model given by path)."""
    built = [p for p in sorted(cache.glob("*")) if p.is_dir() and not p.name.startswith(".")]
    return built[0] if built else None


def weights_digest(model_dir: Path | None) -> str | None:
    """sha256 over a model directory's safetensors files (the initial weights both sides start from)."""
    if model_dir is None:
        return None
    digest = hashlib.sha256()
    for path in sorted(model_dir.glob("*.safetensors")):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def reach_time(curve: list[tuple[float, float]], target: float | None) -> float | None:
    """The first time the curve reaches `target`."""
    if target is None:
        return None
    return next((t for t, v in curve if v >= target - 1e-12), None)


def finish(runs: list[dict], budget: float) -> tuple[str | None, float | None]:
    """Fill each run's final/best score, rates and time to the reference: TRL+vLLM's mean final score, else
    TRL's. Returns (reference system, reference score)."""
    for run in runs:
        curve = run["curve"]
        run["final"] = curve[-1][1] if curve else None
        run["best"] = max((v for _, v in curve), default=None)
        run["gen_tok_s"] = run["generated"] / budget
        run["train_tok_s"] = run["trained"] / budget
    ref_system = next((s for s in ("trl-vllm", "trl") if any(r["system"] == s for r in runs)), None)
    finals = [r["final"] for r in runs if r["system"] == ref_system and r["final"] is not None]
    ref = statistics.fmean(finals) if finals else None
    ref = ref if ref else None  # a reference of 0 is reached by any evaluation: no time to it
    for run in runs:
        run["reach_s"] = reach_time(run["curve"], ref)
    return ref_system, ref


COLUMNS = [
    ("system", "system", "{}"),
    ("seed", "seed", "{}"),
    ("steps", "steps", "{:.0f}"),
    ("final", "final {key}", "{:.3f}"),
    ("best", "best {key}", "{:.3f}"),
    ("reach_s", "time to {ref} (s)", "{:.0f}"),
    ("gen_tok_s", "generated tok/s", "{:.0f}"),
    ("train_tok_s", "trained tok/s", "{:.0f}"),
    ("peak_gb", "peak {mem} (GB)", "{:.2f}"),
]


def _cell(value: Any, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def table(runs: list[dict], key: str, ref_system: str | None, ref: float | None, mem: str) -> str:
    """The Markdown table: one row per run, then the median of each system."""
    ref_text = f"{ref_system} {ref:.3f}" if ref is not None else f"{ref_system} (scored 0)"
    heads = [h.format(key=key, ref=ref_text, mem=mem) for _, h, _ in COLUMNS]
    lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    for run in runs:
        lines.append("| " + " | ".join(_cell(run.get(f), fmt) for f, _, fmt in COLUMNS) + " |")
    for system in dict.fromkeys(r["system"] for r in runs):
        mine = [r for r in runs if r["system"] == system]
        row = {"system": f"**{system}**", "seed": "median"}
        for field, _, _ in COLUMNS[2:]:
            values = [r[field] for r in mine if r.get(field) is not None]
            row[field] = statistics.median(values) if values else None
        lines.append("| " + " | ".join(_cell(row.get(f), fmt) for f, _, fmt in COLUMNS) + " |")
    return "\n".join(lines)


def plot(runs: list[dict], key: str, budget: float, path: Path) -> None:
    """Every run's held-out score against wall-clock seconds, one colour per system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    colours = {s: f"C{i}" for i, s in enumerate(dict.fromkeys(r["system"] for r in runs))}
    styles = ["-", "--", ":", "-."]
    for i, run in enumerate(runs):
        if run["curve"]:
            xs, ys = zip(*run["curve"], strict=True)
            label = f"{run['system']} seed {run['seed']}"
            ax.plot(xs, ys, styles[i % len(styles)], marker="o", ms=3, color=colours[run["system"]], label=label)
    ax.set_xlim(0, budget)
    ax.set_ylim(0, max([0.05, *(1.1 * v for r in runs for _, v in r["curve"])]))
    ax.set_xlabel("wall-clock seconds since the process started (TRL: evaluation time excluded)")
    ax.set_ylabel(f"held-out {key}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
