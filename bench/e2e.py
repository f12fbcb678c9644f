"""Whole-loop throughput of the tiny config: asynchronous (rollout overlaps training) vs synchronous, and
the two staleness admissions under dynamic sampling.

Each mode runs `molt-hpc run` for the same number of steps; rates are taken between the first and
the last training step (start-up excluded) from the run's own `metrics.jsonl`. Modes alternate
over `--repeats` rounds so machine noise hits all alike; the table shows medians and each mode over
sync. The admission pair narrows the staleness bound (1) and widens `rollout.groups_in_flight` (32) so
that admission, not the cap, sets the work in flight; they differ only in `rollout.admission`.

    python bench/e2e.py [--steps 30] [--repeats 2]
    python bench/e2e.py --config configs/smollm2_gym_gpu.toml --modes bound kept --steps 40 --repeats 1

`--config` runs another config, `--modes` a subset; `--set` overrides apply to every mode, after the mode's
own (`--set rollout.groups_in_flight=96` widens the admission pair's cap).
"""

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from molt_hpc.config import load_config  # noqa: E402
from molt_hpc.log import read_metrics  # noqa: E402

NARROW = ["buffer.max_staleness=1", "rollout.groups_in_flight=32"]
MODES = {
    "sync": ["run.sync=true"],
    "async": [],
    "bound": [*NARROW, "rollout.admission=bound"],
    "kept": [*NARROW, "rollout.admission=kept_share"],
}


def one_run(config: str, sets: list[str], steps: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="molt-bench-") as root:
        cmd = [
            sys.executable, "-c", "from molt_hpc.cli import main; main()", "run", config,
            "--set", f"run.root={root}", "--set", f"run.steps={steps}",
            "--set", "checkpoint.interval=0", "--set", "logging.progress=lines",
        ]  # fmt: skip
        cmd += [a for s in sets for a in ("--set", s)]
        print("$", " ".join(cmd), flush=True)
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"the run failed ({done.returncode}):\n{done.stdout[-3000:]}")
        metrics = Path(root) / load_config(ROOT / config, sets).run.name / "metrics.jsonl"
        actor = [r for r in read_metrics(metrics, source="actor") if "wait_s" in r]
        rollout = read_metrics(metrics, source="rollout")
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
    parser.add_argument("--config", default="configs/tiny_cpu.toml")
    parser.add_argument("--modes", nargs="+", choices=sorted(MODES), default=list(MODES))
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    results: dict[str, list[dict[str, float]]] = {mode: [] for mode in args.modes}
    for _ in range(args.repeats):
        for mode in args.modes:
            results[mode].append(one_run(args.config, [*MODES[mode], *args.sets], args.steps))
    med = {m: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for m, rs in results.items()}
    print(f"{args.config} {' '.join(args.sets)}, {args.steps} steps per run, median of {args.repeats} alternating runs")
    for mode in args.modes:
        print(f"  {mode}: {' '.join(MODES[mode]) or '(as the config says)'}")
    base = med[args.modes[0]]["steps_per_min"]
    head = ["mode", "steps/min", "samples/s", "median wait s", "in flight (median peak)", "dropped", "stale",
            f"x {args.modes[0]}"]  # fmt: skip
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for mode, m in med.items():
        ratio = m["steps_per_min"] / base
        cells = [mode, f"{m['steps_per_min']:.1f}", f"{m['samples_per_s']:.1f}", f"{m['wait_s']:.2f}",
                 f"{m['in_flight_max']:.0f}", f"{m['dropped']:.0f}", f"{m['stale']:.0f}", f"{ratio:.2f}"]  # fmt: skip
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
