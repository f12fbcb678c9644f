"""Whole-loop throughput of the tiny config: asynchronous (rollout overlaps training) vs synchronous, and
the two staleness admissions under dynamic sampling.

Each mode runs `molt-hpc run` for the same number of steps; rates are taken between the first and
the last training step (start-up excluded) from the run's own `metrics.jsonl`. Modes alternate
over `--repeats` rounds so machine noise hits all alike; the table shows medians and each mode over
sync. The admission pair narrows the staleness bound (1) and widens `rollout.groups_in_flight` (32) so
that admission, not the cap, sets the work in flight; they differ only in `rollout.admission`.

    python bench/e2e.py [--steps 30] [--repeats 2]
"""

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from molt_hpc.log import read_metrics  # noqa: E402

NARROW = ["buffer.max_staleness=1", "rollout.groups_in_flight=32"]
MODES = {
    "sync": ["run.sync=true"],
    "async": [],
    "bound": [*NARROW, "rollout.admission=bound"],
    "kept": [*NARROW, "rollout.admission=kept_share"],
}


def one_run(sets: list[str], steps: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="molt-bench-") as root:
        cmd = [
            str(Path(sys.executable).parent / "molt-hpc"), "run", "configs/tiny_cpu.toml",
            "--set", f"run.root={root}", "--set", f"run.steps={steps}",
            "--set", "checkpoint.interval=0", "--set", "logging.progress=lines",
        ]  # fmt: skip
        cmd += [a for s in sets for a in ("--set", s)]
        subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True)
        actor = read_metrics(Path(root) / "tiny-cpu" / "metrics.jsonl", source="actor")
        rollout = read_metrics(Path(root) / "tiny-cpu" / "metrics.jsonl", source="rollout")
    span = actor[-1]["time"] - actor[0]["time"]
    samples = sum(r["samples"] for r in actor[1:])
    return {
        "steps_per_min": (len(actor) - 1) / span * 60,
        "samples_per_s": samples / span,
        "wait_s": statistics.median(r["wait_s"] for r in actor),
        "reward_last": actor[-1]["reward"],
        "in_flight_max": statistics.median(r["in_flight_max"] for r in rollout if r.get("groups_accepted")),
        "stale": sum(r.get("groups_filtered_stale", 0) for r in rollout),
        "dropped": sum(r.get("groups_filtered_equal_rewards", 0) for r in rollout),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    results: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    for _ in range(args.repeats):
        for mode, sets in MODES.items():
            results[mode].append(one_run(sets, args.steps))
    med = {m: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for m, rs in results.items()}
    print(f"tiny config, {args.steps} steps per run, median of {args.repeats} alternating runs")
    for mode, sets in MODES.items():
        print(f"  {mode}: {' '.join(sets) or '(configs/tiny_cpu.toml as shipped)'}")
    head = ["mode", "steps/min", "samples/s", "median wait s", "in flight (median peak)", "dropped", "stale", "x sync"]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for mode, m in med.items():
        ratio = m["steps_per_min"] / med["sync"]["steps_per_min"]
        cells = [mode, f"{m['steps_per_min']:.1f}", f"{m['samples_per_s']:.1f}", f"{m['wait_s']:.2f}",
                 f"{m['in_flight_max']:.0f}", f"{m['dropped']:.0f}", f"{m['stale']:.0f}", f"{ratio:.2f}"]  # fmt: skip
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
