"""Where a run's training steps spend their time, from its `metrics.jsonl`: rollout wait, train, refit, checkpoint.

Every actor record carries `wait_s` (waiting for a batch of rollouts, engine changes served meanwhile),
`step_s` (the training step), `refit_s` (the refit after it) and `checkpoint_s` (when one was written);
their sum is the step's wall time. The table gives each part's mean and median per step and its share
of the total, over every step or the steps after `--skip` (the first waits include engine start-up).

    python bench/step_split.py RUN_DIR [--skip 2] [--out rows.jsonl]
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

from molt_hpc.log import read_metrics
from molt_hpc.plan.step_split import PARTS, split


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--skip", type=int, default=2, help="leave out the first steps (start-up)")
    ap.add_argument("--out", type=Path, help="also append the rows as JSON lines (bench/gpu.py's format)")
    args = ap.parse_args()
    records = read_metrics(args.run_dir / "metrics.jsonl", source="actor")
    kept = records[args.skip :]
    if not kept:
        print(f"{args.run_dir}: {len(records)} steps recorded, none after --skip {args.skip}")
        return 1
    parts = split(kept)
    total = [sum(xs) for xs in zip(*parts.values(), strict=True)]
    whole = sum(total)
    print(f"{args.run_dir.name}: steps {kept[0]['step']}-{kept[-1]['step']} of {len(records)}")
    print("| part | mean s/step | median s/step | share |")
    print("|---|---:|---:|---:|")
    rows = []
    for key, name in [*PARTS.items(), ("total", "step total")]:
        xs = total if key == "total" else parts[key]
        share = sum(xs) / whole if whole else 0.0
        print(f"| {name} | {statistics.fmean(xs):.3f} | {statistics.median(xs):.3f} | {100 * share:.0f} % |")
        rows.append({"bench": "step split", "case": name, "value": statistics.fmean(xs), "unit": "s/step",
                     "note": f"median {statistics.median(xs):.3f} s, {100 * share:.0f} % of step time"})  # fmt: skip
    if args.out is not None:
        with open(args.out, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
