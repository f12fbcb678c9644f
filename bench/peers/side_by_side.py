"""molt-hpc side by side with TRL's GRPOTrainer: the same task, model, settings and wall-clock budget.

Every shared setting comes from ONE molt-hpc config (after its `--set` overrides) and is mapped onto TRL's
`GRPOConfig` (`mapping.py`, TRL's defaults kept elsewhere). Each run is a fresh Python process started by this
driver and stopped at `--budget-s` from its start: molt-hpc by SIGTERM (`molt-hpc run`, many steps), TRL by its
own callback (`trl_run.py`; its held-out evaluation is off its clock). Reported per run: held-out pass@1 against
time, time to reach TRL(+vLLM)'s final mean score, generated and trained tokens/s, and peak memory (GPU memory
used on CUDA, else the process tree's summed PSS). Runs are kept in `--out`: logs, records, results.json, plot.

    python bench/peers/side_by_side.py --budget-s 300 --seeds 0 1 2 --out runs/peers
    python bench/peers/side_by_side.py --config configs/smollm2_gym_gpu.toml --systems trl trl-vllm molt-builtin
"""

import argparse
import contextlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ROOT, SYSTEMS, bench_config, model_dir
from mapping import differences, grpo_changes, molt_command
from report import finish, molt_summary, plot, table, trl_summary, weights_digest

STOP_GRACE_S = 300.0
"""How long a stopped molt-hpc run may take to checkpoint and exit before its process group is killed."""


class MemorySampler(threading.Thread):
    """Peaks of a process tree: summed PSS (shared pages counted once) and the GPUs' used memory over its start."""

    def __init__(self):
        super().__init__(daemon=True)
        self.pid, self.stop = 0, threading.Event()
        self.host_peak, self.gpu_peak = 0, None
        self.gpu_base = gpu_used()

    def run(self) -> None:
        import psutil

        while not self.stop.wait(0.5):
            try:
                procs = [psutil.Process(self.pid), *psutil.Process(self.pid).children(recursive=True)]
            except psutil.NoSuchProcess:
                continue
            total = 0
            for p in procs:
                with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                    total += p.memory_full_info().pss
            self.host_peak = max(self.host_peak, total)
            used = gpu_used()
            if used is not None and self.gpu_base is not None:
                self.gpu_peak = max(self.gpu_peak or 0, used - self.gpu_base)


def gpu_used() -> int | None:
    """Bytes used on every visible GPU (nvidia-smi), or None without one."""
    if shutil.which("nvidia-smi") is None:
        return None
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=False).stdout  # fmt: skip
    values = [int(x) for x in out.split() if x.strip().isdigit()]
    return sum(values) * 2**20 if values else None


def command(system: str, args, overrides: list[str], name: str, seed: int, cfg, t0: float) -> list[str]:
    """The run's command line: `molt-hpc run` or `trl_run.py`, both with the same config and overrides."""
    seeded = [*overrides, f"run.seed={seed}"]
    if system.startswith("molt"):
        molt_args, _ = molt_command(args.config, overrides, system=system, root=str(args.out), name=name,
                                    seed=seed, cfg=cfg, model=str(args.model))  # fmt: skip
        return [str(Path(sys.executable).parent / "molt-hpc"), *molt_args]
    cmd = [sys.executable, str(Path(__file__).parent / "trl_run.py"), "--config", args.config,
           "--out", str(args.out / name), "--models", str(args.out / "models"), "--t0", repr(t0),
           "--budget-s", str(args.budget_s), "--eval-every-s", str(args.trl_eval_every_s)]  # fmt: skip
    for item in seeded:
        cmd += ["--set", item]
    return [*cmd, "--vllm"] if system == "trl-vllm" else cmd


def run_one(system: str, seed: int, args, cfg, overrides: list[str]) -> dict:
    """Start one run, stop it at the budget, and return what the driver measured of it."""
    name = f"{system}-s{seed}"
    if (args.out / name).exists():
        raise SystemExit(f"{args.out / name} exists: give a fresh --out (a molt-hpc run there would resume)")
    log = args.out / f"{name}.log"
    t0 = time.time()
    cmd = command(system, args, overrides, name, seed, cfg, t0)
    print(f"== {name}: {' '.join(cmd)}", flush=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    sampler = MemorySampler()  # the GPU memory in use before the run
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    sampler.pid = proc.pid
    sampler.start()
    if system.startswith("molt"):
        code = _wait(proc, t0 + args.budget_s)
        if code is None:
            proc.send_signal(signal.SIGTERM)  # checkpoint at the next step boundary, then stop
            code = _wait(proc, time.time() + STOP_GRACE_S)
    else:  # TRL stops itself; its evaluations are off its clock, so it may run past the budget in wall time
        code = _wait(proc, t0 + args.budget_s + max(args.budget_s, 600.0) * 3)
    if code is None:
        os.killpg(proc.pid, signal.SIGKILL)
        code = proc.wait()
    sampler.stop.set()
    sampler.join()
    print(f"   {name}: exit {code} after {time.time() - t0:.0f} s; log {log}", flush=True)
    gpu = sampler.gpu_peak
    return {"system": system, "seed": seed, "name": name, "exit": code, "t0": t0, "log": str(log),
            "peak_host_gb": sampler.host_peak / 2**30, "peak_gpu_gb": None if gpu is None else gpu / 2**30}  # fmt: skip


def _wait(proc: subprocess.Popen, deadline: float) -> int | None:
    while time.time() < deadline:
        code = proc.poll()
        if code is not None:
            return code
        time.sleep(0.5)
    return None


def print_settings(args, cfg, overrides: list[str]) -> dict:
    """Print (and return) every argument both sides use: the GRPOConfig and the molt-hpc command line."""
    changes = grpo_changes(cfg, output_dir=str(args.out / "trl-sN" / "trainer"), seed=cfg.run.seed,
                           use_vllm="trl-vllm" in args.systems)  # fmt: skip
    settings: dict = {"config": args.config, "overrides": overrides, "grpo_changes": changes}
    if importlib.util.find_spec("trl") is not None:
        from trl import GRPOConfig

        try:
            settings["grpo_config"] = GRPOConfig(**changes).to_dict()
        except ValueError as err:  # e.g. bf16 asked on a machine without a GPU
            settings["grpo_config"] = f"cannot be built on this machine: {err}"
    molt_args, added = molt_command(args.config, overrides, system="molt-builtin", root=str(args.out),
                                    name="molt-builtin-sN", seed=cfg.run.seed, cfg=cfg,
                                    model=str(args.model))  # fmt: skip
    settings.update({"molt_command": ["molt-hpc", *molt_args], "molt_bench_overrides": added})
    print("TRL GRPOConfig, changed from its defaults:", json.dumps(changes, indent=1))
    print("TRL GRPOConfig, in full:", json.dumps(settings.get("grpo_config"), default=str, sort_keys=True))
    print("molt-hpc:", " ".join(settings["molt_command"]))
    return settings


def summarise(runs: list[dict], args, cfg, notes: list[str]) -> str:
    key = "pass@1" if 1 in cfg.eval.k else f"pass@{cfg.eval.k[0]}"
    for run in runs:
        if run["system"].startswith("molt"):
            run.update(molt_summary(args.out / run["name"], run["t0"], args.budget_s, key))
        else:
            run.update(trl_summary(args.out / run["name"], args.budget_s, key))
            notes += [n for n in run.pop("notes") if n not in notes]
        run["peak_gb"] = run["peak_gpu_gb"] if run["peak_gpu_gb"] is not None else run["peak_host_gb"]
        if run["exit"] != 0:
            notes.append(f"{run['name']} exited with code {run['exit']}: see {run['log']}")
    ref_system, ref = finish(runs, args.budget_s)
    mem = "GPU memory" if any(r["peak_gpu_gb"] is not None for r in runs) else "host PSS"
    shared = weights_digest(model_dir(cfg, args.out / "models"))
    theirs = {r["weights"] for r in runs if r.get("weights") is not None}
    if theirs - {shared}:
        notes.append(f"initial weights DIFFER: TRL's sha256 {shared}, molt-hpc's {sorted(theirs)}")
    elif theirs:
        notes.append(f"initial weights: sha256 {shared} on both sides (molt-hpc's runs built their own copy)")
    elif not args.report:
        notes.append(f"initial weights: both sides read the driver's model directory (sha256 {shared})")
    text = table(runs, key, ref_system, ref, mem)
    text += "\n\nNotes:\n" + "\n".join(f"- {n}" for n in notes)
    plot(runs, key, args.budget_s, args.out / "pass_at_1.png")
    (args.out / "results.json").write_text(json.dumps({"budget_s": args.budget_s, "metric": key,
        "reference": {"system": ref_system, "score": ref}, "runs": runs, "notes": notes}, indent=1))  # fmt: skip
    (args.out / "results.md").write_text(text + "\n")
    return text


def parse_args() -> argparse.Namespace:
    cuda = shutil.which("nvidia-smi") is not None
    vllm = importlib.util.find_spec("vllm") is not None
    default = ["trl", "trl-vllm", "molt-builtin", "molt-vllm"] if cuda and vllm else ["trl", "molt-builtin"]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/tiny_cpu.toml", help="the molt-hpc config both sides read")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="dotted override (repeatable)")
    parser.add_argument("--budget-s", type=float, default=300.0, help="wall-clock seconds per run")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=default)
    parser.add_argument("--out", type=Path, default=Path("runs/peers"), help="logs, records, results, plot")
    parser.add_argument("--trl-eval-every-s", type=float, default=None, help="default: budget / 10")
    parser.add_argument("--report", action="store_true",
                        help="run nothing: summarise every run in OUT/runs.jsonl (made by several calls)")  # fmt: skip
    args = parser.parse_args()
    args.out = args.out.resolve()
    if Path(args.config).is_file():  # the runs start in the repository root
        args.config = os.path.relpath(Path(args.config).resolve(), ROOT)
    args.trl_eval_every_s = args.trl_eval_every_s or args.budget_s / 10
    return args


def main() -> None:
    args = parse_args()
    os.chdir(ROOT)
    cfg, overrides = bench_config(args.config, args.overrides)
    args.out.mkdir(parents=True, exist_ok=True)
    args.model = model_dir(cfg, args.out / "models")
    print(f"model directory (both sides): {args.model}")
    ledger = args.out / "runs.jsonl"
    if args.report:
        runs = [json.loads(line) for line in ledger.read_text().splitlines() if line.strip()]
        args.budget_s = runs[0]["budget_s"]
    else:
        settings = print_settings(args, cfg, overrides)
        (args.out / "settings.json").write_text(json.dumps(settings, indent=1, default=str))
        runs = []
        for seed in args.seeds:
            for system in args.systems:
                runs.append({**run_one(system, seed, args, cfg, overrides), "budget_s": args.budget_s})
                with ledger.open("a") as out:  # every run this --out has seen, for --report
                    out.write(json.dumps(runs[-1]) + "\n")
    systems = {r["system"] for r in runs}
    notes = differences(cfg, "trl-vllm" if "trl-vllm" in systems else "trl")
    print(summarise(runs, args, cfg, notes))
    print(f"results: {args.out / 'results.json'}, plot: {args.out / 'pass_at_1.png'}")


if __name__ == "__main__":
    main()
