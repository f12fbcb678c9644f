"""Whole-loop throughput of the tiny config: asynchronous (rollout overlaps training) vs synchronous.

Each mode runs `molt-hpc run` for the same number of steps; rates are taken between the first and
the last training step (start-up excluded) from the run's own `metrics.jsonl`. Modes alternate
over `--repeats` rounds so machine noise hits both alike; the table shows medians and async/sync.

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


def one_run(sync: bool, steps: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="molt-bench-") as root:
        cmd = [
            str(Path(sys.executable).parent / "molt-hpc"), "run", "configs/tiny_cpu.toml",
            "--set", f"run.root={root}", "--set", f"run.steps={steps}", "--set", f"run.sync={str(sync).lower()}",
            "--set", "checkpoint.interval=0", "--set", "logging.progress=lines",
        ]  # fmt: skip
        subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True)
        actor = read_metrics(Path(root) / "tiny-cpu" / "metrics.jsonl", source="actor")
    span = actor[-1]["time"] - actor[0]["time"]
    samples = sum(r["samples"] for r in actor[1:])
    return {
        "steps_per_min": (len(actor) - 1) / span * 60,
        "samples_per_s": samples / span,
        "wait_s": statistics.median(r["wait_s"] for r in actor),
        "reward_last": actor[-1]["reward"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    results: dict[str, list[dict[str, float]]] = {"sync": [], "async": []}
    for _ in range(args.repeats):
        for mode in ("sync", "async"):
            results[mode].append(one_run(mode == "sync", args.steps))
    med = {m: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for m, rs in results.items()}
    print(f"tiny config, {args.steps} steps per run, median of {args.repeats} alternating runs")
    print(f"{'mode':<6} {'steps/min':>10} {'samples/s':>10} {'median wait s':>14} {'x sync':>7}")
    for mode in ("sync", "async"):
        m = med[mode]
        ratio = m["steps_per_min"] / med["sync"]["steps_per_min"]
        print(f"{mode:<6} {m['steps_per_min']:>10.1f} {m['samples_per_s']:>10.1f} {m['wait_s']:>14.2f} {ratio:>7.2f}")


if __name__ == "__main__":
    main()
