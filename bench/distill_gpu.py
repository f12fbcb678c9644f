"""On-policy distillation against RL alone on one GPU, same wall-clock budget, judged on held-out pass@k.

1. RL alone: `configs/smollm2_gym_gpu.toml` (SmolLM2-135M-Instruct, GRPO on reasoning-gym arithmetic) for
   `--budget` seconds from its launch. Its final checkpoint is the teacher, and its held-out evaluations are
   the RL-alone curve.
2. Distillation: `configs/smollm2_distill_gpu.toml`, the same base model as a fresh student, trained on the
   teacher's per-token signal alone, for the same budget.

Each arm is one call (`--arm rl`, then `--arm distill`; a call of either fits a 10-minute machine lease), and
`--arm report` prints, per arm, the held-out pass@1/pass@8 against seconds since its launch, its steps and
training reward, and the first second at which the student's pass@1 reached the teacher's (the RL run's last
evaluation). `--set` overrides go to both arms (e.g. the converted model's directory as `model.path`).

    python bench/distill_gpu.py --arm rl --root runs/distill-gpu --budget 300
    python bench/distill_gpu.py --arm distill --root runs/distill-gpu --budget 300
    python bench/distill_gpu.py --arm report --root runs/distill-gpu
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from distill import ROOT, run_arm

from molt_hpc.log import read_metrics

CONFIGS = {"rl": "configs/smollm2_gym_gpu.toml", "distill": "configs/smollm2_distill_gpu.toml"}
NAMES = {"rl": "RL alone", "distill": "distillation"}


def evals(run_dir: Path, launched: float) -> list[dict]:
    """The run's held-out evaluations, each with `elapsed`: seconds from the launch to the record."""
    rows = read_metrics(run_dir / "metrics.jsonl", source="eval")
    return [{**r, "elapsed": r["time"] - launched} for r in rows]


def run(args) -> None:
    root = args.root.absolute()
    root.mkdir(parents=True, exist_ok=True)
    sets = [*args.overrides, "eval.every=20", "checkpoint.interval=20"]
    if args.arm == "distill":
        sets.append(f"distill.teacher={root / 'rl'}")
    print(f"{NAMES[args.arm]}: {args.config or CONFIGS[args.arm]} for {args.budget:g} s, --set {sets}", flush=True)
    launched = time.time()
    run_dir, records = run_arm(NAMES[args.arm], args.config or CONFIGS[args.arm], root, args.budget, sets)
    (root / f"{run_dir.name}.json").write_text(json.dumps({"launched": launched, "budget": args.budget}))
    print(f"{NAMES[args.arm]}: {len(records)} steps within the budget; run directory {run_dir}", flush=True)


def report(args) -> None:
    root = args.root.absolute()
    arms = {}
    for arm in ("rl", "distill"):
        run_dir = root / arm
        if not (root / f"{arm}.json").exists():
            continue
        meta = json.loads((root / f"{arm}.json").read_text())
        steps = [r for r in read_metrics(run_dir / "metrics.jsonl", source="actor") if "step" in r]
        in_budget = [r for r in steps if r["time"] - meta["launched"] <= meta["budget"]]
        rollout = [r for r in read_metrics(run_dir / "metrics.jsonl", source="rollout") if r.get("window_s")]
        arms[arm] = {"evals": evals(run_dir, meta["launched"]), "steps": in_budget, "rollout": rollout}
    teacher = arms["rl"]["evals"][-1] if "rl" in arms and arms["rl"]["evals"] else None
    for arm, data in arms.items():
        rewards = [r["reward"] for r in data["steps"]]
        tail = rewards[len(rewards) - max(1, len(rewards) // 4) :]
        print(f"{NAMES[arm]}: {len(rewards)} steps within the budget, training reward over the last quarter "
              f"{statistics.fmean(tail) if tail else float('nan'):.3f}")  # fmt: skip
        generated = statistics.median(r["tokens_per_s"] for r in data["rollout"]) if data["rollout"] else float("nan")
        scored = [r["distill/teacher_tokens_per_s"] for r in data["steps"] if r.get("distill/teacher_tokens_per_s")]
        print(f"  engine: {generated:.0f} generated tokens/s (median of the rollout windows)"
              + (f"; teacher: {statistics.median(scored):.0f} scored tokens/s of its forwards (median of the steps)"
                 if scored else ""))  # fmt: skip
        for e in data["evals"]:
            print(f"  eval version {e['eval_version']:>4} at {e['elapsed']:6.0f} s: pass@1 {e.get('eval_pass@1')}, "
                  f"pass@8 {e.get('eval_pass@8')}, mean reward {e.get('eval_reward')}")  # fmt: skip
    if teacher is None or "distill" not in arms:
        return
    plot(arms, teacher, root / "distill_vs_rl_gpu.png")
    goal = teacher.get("eval_pass@1") or 0.0
    reached = [e["elapsed"] for e in arms["distill"]["evals"] if (e.get("eval_pass@1") or 0.0) >= goal]
    rl_reached = [e["elapsed"] for e in arms["rl"]["evals"] if (e.get("eval_pass@1") or 0.0) >= goal]
    student = f"at {min(reached):.0f} s" if reached else "did not reach it"
    print(f"teacher (RL alone's last evaluation, version {teacher['eval_version']}): pass@1 {goal:.3f}; RL alone "
          f"reached it at {min(rl_reached):.0f} s; distillation {student}")  # fmt: skip


def plot(arms: dict, teacher: dict, out: Path) -> None:
    """Held-out pass@1 of both arms against seconds since their launch, the teacher's last evaluation dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for arm, colour in (("rl", "tab:blue"), ("distill", "tab:orange")):
        points = [(e["elapsed"], e.get("eval_pass@1") or 0.0) for e in arms[arm]["evals"]]
        ax.plot(*zip(*points, strict=True), marker="o", color=colour, label=NAMES[arm])
    ax.axhline(teacher.get("eval_pass@1") or 0.0, color="grey", linestyle="--", linewidth=1,
               label=f"teacher's last evaluation (RL alone, version {teacher['eval_version']})")  # fmt: skip
    ax.set_xlabel("seconds since launch (start-up included)")
    ax.set_ylabel("held-out pass@1 (64 prompts x 8 samples, T = 1)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)
    print(f"plot: {out}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arm", choices=("rl", "distill", "report"), required=True)
    p.add_argument("--root", type=Path, default=ROOT / "runs" / "distill-gpu")
    p.add_argument("--budget", type=float, default=300.0, help="seconds per run, from its launch")
    p.add_argument("--config", help="the arm's config instead of the shipped one")
    p.add_argument("--set", action="append", default=[], dest="overrides", metavar="KEY=VALUE")
    args = p.parse_args()
    report(args) if args.arm == "report" else run(args)


if __name__ == "__main__":
    main()
