"""`molt-hpc plot RUN_DIR`: reward, KL and throughput against step and wall time, as one PNG.

Reads only `metrics.jsonl`, so it works on a live run, a finished one, or a copy of the file.
"""

from pathlib import Path

from molt_hpc.log import read_metrics, training_steps

STAGE_PANELS = {  # the supervised stages' records (molt-hpc sft, molt-hpc rm train) have no reward
    "sft_loss": [("SFT loss (reply tokens)", [("sft_loss", "training rows"), ("eval_loss", "held-out rows")]),
                 ("trainer tokens/s", [("tokens_per_s", None)])],
    "rm_loss": [("reward-model loss (training pairs)", [("rm_loss", None)]),
                ("pair accuracy", [("rm_accuracy", "training pairs"), ("eval_accuracy", "held-out pairs")]),
                ("trainer tokens/s", [("tokens_per_s", None)])],
}  # fmt: skip


def _series(records: list[dict], key: str, t0: float) -> tuple[list[float], list[float], list[float]]:
    rows = [r for r in records if r.get(key) is not None and "step" in r]
    if not rows:
        return [], [], []
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
    panels = [
        ("reward (mean over every finished sample)", [("reward", "all finished"), ("reward_trained", "trained")]),
        (kl[1], [(kl[0], None)]),
        ("trainer tokens/s", [("tokens_per_s", None)]),
    ]
    if any("distill/reverse_kl" in r for r in records):  # [distill]: how far the student is from its teacher
        panels.append(("sampled reverse KL to the teacher (nats per action token)", [("distill/reverse_kl", None)]))
    if any("mismatch_abs_mean" in r for r in records):  # the observatory: same-version tokens only
        panels.append(("train-inference mismatch, same weights (|trainer - engine| log-prob)",
                       [("mismatch_abs_mean", "mean"), ("mismatch_k3", "k3 KL")]))  # fmt: skip
    panels = next((p for key, p in STAGE_PANELS.items() if any(key in r for r in records)), panels)
    evals = [{**r, "step": r["eval_version"]} for r in read_metrics(run_dir / "metrics.jsonl", source="eval")]
    if evals:  # the held-out evaluation (`[eval]`): pass@k and mean reward at the version evaluated
        keys = sorted({k for r in evals for k in r if k.startswith("eval_pass@")}, key=lambda k: int(k[10:]))
        lines = [(k, k[5:]) for k in keys] + [("eval_reward", "mean reward")]
        panels = [*panels, ("held-out evaluation (at the policy version evaluated)", lines)]
    fig, axes = plt.subplots(len(panels), 2, figsize=(11, 2.7 * len(panels)), squeeze=False)
    for row, (title, lines) in enumerate(panels):
        drawn = False
        source = evals if title.startswith("held-out evaluation") else records
        for key, label in lines:
            steps, minutes, values = _series(source, key, min(r["time"] for r in records))
            drawn = drawn or bool(values)
            for col, xs in enumerate((steps, minutes)):
                if values:
                    axes[row][col].plot(xs, values, marker=".", linewidth=1, label=label)
        for col, xlabel in enumerate(("step", "minutes")):
            ax = axes[row][col]
            ax.set_title(title if drawn else f"{title} (not recorded)", fontsize=10)
            ax.set_xlabel(xlabel)
            ax.grid(alpha=0.3)
            if drawn and len(lines) > 1:
                ax.legend(fontsize=8)
    fig.suptitle(run_dir.name)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def _quarters(records: list[dict], key: str) -> tuple[float, float, int, float, int] | None:
    """(first-quarter mean, last-quarter mean, steps, best value, its step) of `key`, or None if < 4 steps."""
    values = [(r["step"], r[key]) for r in records if r.get(key) is not None]
    if len(values) < 4:
        return None
    q = len(values) // 4
    best_step, best = max(values, key=lambda x: x[1])
    first, last = sum(v for _, v in values[:q]) / q, sum(v for _, v in values[-q:]) / q
    return first, last, len(values), best, best_step


def reward_summary(records: list[dict]) -> str:
    """Mean reward (every finished sample) of the first and last quarter of steps, the best step, and
    the same quarters of the trained samples' reward."""
    honest = _quarters(records, "reward")
    if honest is None:
        n = sum(1 for r in records if r.get("reward") is not None)
        return f"reward: {n} steps recorded, too few to summarise"
    first, last, n, best, best_step = honest
    line = (
        f"reward: first quarter {first:.3f} -> last quarter {last:.3f} (best {best:.3f} at step {best_step}, {n} steps)"
    )
    trained = _quarters(records, "reward_trained")
    if trained is not None:
        line += f"; trained groups {trained[0]:.3f} -> {trained[1]:.3f}"
    return line


def distill_summary(records: list[dict]) -> str | None:
    """With `[distill]`: the sampled reverse KL to the teacher, first quarter -> last quarter of the steps."""
    quarters = _quarters(records, "distill/reverse_kl")
    if quarters is None:
        return None
    return f"reverse KL to the teacher: first quarter {quarters[0]:.3f} -> last quarter {quarters[1]:.3f} nats/token"


def reward_model_summary(run_dir) -> list[str]:
    """With a reward model: its raw score and the env's reward over the rollout records, first → last quarter."""
    records = read_metrics(Path(getattr(run_dir, "path", run_dir)) / "metrics.jsonl", source="rollout")
    records = [{**r, "step": i} for i, r in enumerate(records)]  # rollout windows, in order
    lines = []
    for key, what in (("env_reward_mean", "env reward (task)"), ("rm_score_mean", "reward-model score")):
        quarters = _quarters(records, key)
        if quarters is not None:
            lines.append(f"{what}: first quarter {quarters[0]:.3f} -> last quarter {quarters[1]:.3f}")
    return lines
