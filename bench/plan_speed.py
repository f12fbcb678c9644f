"""The speed model against a run, in one command: calibrate this machine (`molt-hpc plan --calibrate`), run
the config, then print the plan's prediction at the run's measured lengths beside what the run measured (as
`molt-hpc status` prints it), once with the config's own profile and once with the calibrated one.

    python bench/plan_speed.py configs/tiny_cpu.toml --steps 40
    python bench/plan_speed.py configs/smollm2_math_gpu.toml --steps 30 --set model.path=DIR \\
        --set algorithm.dynamic_sampling=false

The calibration and the run go one after the other on the same machine: run it on an otherwise idle one
(a calibration beside other work measures that moment's share of the machine: `docs/scale.md`). The run's
own command is printed before it starts; its directory is kept (`--root`, default `runs/plan-speed`).
"""

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_command(config: str, sets: list[str], steps: int, root: Path, name: str) -> list[str]:
    extra = [f"run.steps={steps}", f"run.root={root}", f"run.name={name}", "checkpoint.interval=0"]
    cli = [sys.executable, "-c", "from molt_hpc.cli import main; main()"]  # the `molt-hpc` command of this Python
    return [*cli, "run", config, *(a for s in [*sets, *extra] for a in ("--set", s))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--root", type=Path, default=ROOT / "runs" / "plan-speed")
    ap.add_argument("--name", default="run")
    args = ap.parse_args()
    import torch

    from molt_hpc.config import load_config
    from molt_hpc.log import read_metrics
    from molt_hpc.plan.calibrate import SHARED, calibrate, calibration_text
    from molt_hpc.plan.speed_text import run_speed_lines

    kind = "cuda" if torch.cuda.is_available() else "cpu"
    values = calibrate(load_config(args.config, args.sets), kind)
    print(calibration_text(values, kind), flush=True)
    run_dir = args.root / args.name
    if run_dir.exists():
        print(f"{run_dir} exists: remove it, or pass another --name")
        return 2
    cmd = run_command(args.config, args.sets, args.steps, args.root, args.name)
    print("\n$ " + " ".join(cmd), flush=True)
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        print(done.stdout[-2000:], done.stderr[-2000:])
        return done.returncode
    actor = read_metrics(run_dir / "metrics.jsonl", source="actor")
    rollout = read_metrics(run_dir / "metrics.jsonl", source="rollout")
    # the profile `plan --calibrate` prints for a config: the shared-device pair stays out, as it does there
    calibrated = [f"plan.{kind}.{k}={v:.6g}" for k, v in values.items() if k not in SHARED]
    for label, extra in (("the config's own profile", []), ("the calibrated profile", calibrated)):
        cfg = load_config(run_dir / "config.toml", extra)
        print(f"\n{run_dir.name}, {len(actor)} steps, {label} (plan.{kind}):")
        print("\n".join(run_speed_lines(cfg, actor, rollout, run_dir)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
