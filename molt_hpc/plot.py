"""`molt-hpc plot RUN_DIR`: reward, KL and throughput against step and wall time, as one PNG.

Reads only `metrics.jsonl`, so it works on a live run, a finished one, or a copy of the file.
"""

from pathlib import Path

from molt_hpc.log import read_metrics, training_steps


def _series(records: list[dict], key: str) -> tuple[list[float], list[float], list[float]]:
    rows = [r for r in records if r.get(key) is not None and "step" in r]
    if not rows:
        return [], [], []
    t0 = min(r["time"] for r in records)
    return [r["step"] for r in rows], [(r["time"] - t0) / 60 for r in rows], [r[key] for r in rows]


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write the plot (default `RUN_DIR/plots/metrics.png`) and return its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    records = training_steps(read_metrics(run_dir / "metrics.jsonl", source="actor"))
    if not records:
        raise ValueError(f"{run_dir / 'metrics.jsonl'} has no training steps yet; nothing to plot")
    out = Path(out) if out else run_dir / "plots" / "metrics.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    kl = ("kl", "KL to reference") if any("kl" in r for r in records) else ("kl_rollout", "KL to the rollout policy")
    panels = [("reward", "reward (mean)"), kl, ("tokens_per_s", "trainer tokens/s")]
    fig, axes = plt.subplots(len(panels), 2, figsize=(11, 8), squeeze=False)
    for row, (key, title) in enumerate(panels):
        steps, minutes, values = _series(records, key)
        for col, (xs, xlabel) in enumerate(((steps, "step"), (minutes, "minutes"))):
            ax = axes[row][col]
            ax.plot(xs, values, marker=".", linewidth=1)
            ax.set_title(title if values else f"{title} (not recorded)", fontsize=10)
            ax.set_xlabel(xlabel)
            ax.grid(alpha=0.3)
    fig.suptitle(run_dir.name)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def reward_summary(records: list[dict]) -> str:
    """Mean reward of the first and last quarter of steps, and the best step."""
    rewards = [(r["step"], r["reward"]) for r in records if r.get("reward") is not None]
    if len(rewards) < 4:
        return f"reward: {len(rewards)} steps recorded, too few to summarise"
    q = len(rewards) // 4
    first = sum(v for _, v in rewards[:q]) / q
    last = sum(v for _, v in rewards[-q:]) / q
    best_step, best = max(rewards, key=lambda x: x[1])
    return (
        f"reward: first quarter {first:.3f} -> last quarter {last:.3f} "
        f"(best {best:.3f} at step {best_step}, {len(rewards)} steps)"
    )
