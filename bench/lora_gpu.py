"""LoRA on one GPU: a Qwen3-8B-shaped model against its plan and its full fine-tune's refit, and SmolLM2-135M
LoRA against its full fine-tune on the same task and time.

Every run is `molt-hpc run` of a shipped config with the overrides printed, trainer and engine on the one
GPU; each arm is one call, so it fits a 10-minute machine lease. `--arm report` prints what the arms left
under `--root`.

  --arm model   writes Qwen3-8B's shape (configs/models/qwen3-8b) with random bf16 weights (seed 0) under
                ROOT/qwen3-8b, with the tokenizer files of `--tokenizer` (SmolLM2's: its 49,152 ids lie
                below Qwen3's 151,936, and ids it does not know decode to nothing)
  --arm q8      configs/8b_lora_onegpu.toml on that model for `--steps` steps with `--engine` builtin|vllm,
                `--mode lora` as shipped, or `--mode full`: [actor.lora] dropped and actor.offload =
                'optimizer' (its refits are the baseline of the adapter refits; the plan puts it at 155 GiB
                at this shape, more than one H200: `bench/gpu_refit.py` times a full refit read in place
                without training). Measured: the GPU's peak memory in use (nvidia-smi, every 0.5 s)
                against the plan's, steps per minute after the first step, the refit seconds per step.
  --arm smol    configs/smollm2_gym_gpu.toml for `--budget` seconds from its launch, `--mode full` as
                shipped or `--mode lora` (`--set` adds the adapters' settings)
  --arm report  the tables

    python bench/lora_gpu.py --arm model --root /tmp/lora --tokenizer DIR
    python bench/lora_gpu.py --arm q8 --root /tmp/lora --engine builtin --mode lora --steps 6
    python bench/lora_gpu.py --arm smol --root /tmp/lora --mode lora --budget 240 --set model.path=DIR
    python bench/lora_gpu.py --arm report --root /tmp/lora
"""

import argparse
import json
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MOLT = str(Path(sys.executable).parent / "molt-hpc")
Q8_SETS = [
    "model.architecture='configs/models/qwen3-8b'", "model.attn_implementation='sdpa'",
    "rollout.max_new_tokens=128", "rollout.max_total_tokens=640", "engines.max_model_len=640",
    "actor.groups_per_step=8", "rollout.groups_in_flight=8", "checkpoint.interval=0", "plan.host_memory_gib=120",
    "data.apply_chat_template=false",
]  # fmt: skip
"""A short-answer version of the shipped 8B recipe: the bench measures memory, refits and step rates."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def write_model(root: Path, tokenizer: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out = root / "qwen3-8b"
    config = AutoConfig.from_pretrained(ROOT / "configs" / "models" / "qwen3-8b")
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out, max_shard_size="4GB")
    for name in TOKENIZER_FILES:
        if (tokenizer / name).exists():
            shutil.copy(tokenizer / name, out / name)
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params / 1e9:.2f}B parameters written to {out} in {time.perf_counter() - t0:.0f} s", flush=True)


class GpuMemory:
    """The GPU's memory in use (nvidia-smi, MiB), sampled every 0.5 s in a thread: the peak of the whole GPU."""

    def __init__(self) -> None:
        self.peak_mib = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True)  # fmt: skip
            if out.returncode == 0 and out.stdout.strip():
                self.peak_mib = max(self.peak_mib, int(out.stdout.split()[0]))

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.peak_mib / 1024


def q8_config(args) -> Path:
    """The arm's config file: the shipped 8B LoRA recipe with `Q8_SETS`, full mode without its adapters."""
    from molt_hpc.config import load_config, to_toml

    name = f"q8-{args.mode}-{args.engine}" + (f"-{args.tag}" if args.tag else "")
    sets = [*Q8_SETS, f"model.path='{args.root / 'qwen3-8b'}'", f"run.root='{args.root}'", f"run.name='{name}'",
            f"run.steps={args.steps}", f"engines.kind='{args.engine}'"]  # fmt: skip
    if args.engine == "vllm":
        sets += ["engines.enforce_eager=true", "engines.gpu_memory_utilization=0.3"]
    sets += args.overrides  # last, so that a user's `--set` wins over the arm's own
    cfg = load_config(ROOT / "configs" / "8b_lora_onegpu.toml", sets)
    if args.mode == "full":
        cfg = cfg.model_copy(update={"actor": cfg.actor.model_copy(update={"lora": None, "offload": "optimizer"})})
    path = args.root / f"{name}.toml"
    path.write_text(to_toml(cfg))
    print(f"{name}: configs/8b_lora_onegpu.toml --set {sets}" + (" without [actor.lora], actor.offload = 'optimizer'"
          if args.mode == "full" else ""), flush=True)  # fmt: skip
    return path


def planned_gib(config: Path) -> float:
    from molt_hpc.config import load_config
    from molt_hpc.plan import plan_config

    plan, _ = plan_config(load_config(config), local=True)
    return plan.check("trainer GPU").need / 2**30


def launch(config: Path, root: Path, name: str, budget: float) -> float:
    """`molt-hpc run config`, stopped (Ctrl-C: a checkpoint, then the end) `budget` s after launch; the launch time."""
    shutil.rmtree(root / name, ignore_errors=True)
    log = open(root / f"{name}.out", "w")  # noqa: SIM115 (the run writes it until it ends)
    launched = time.time()
    proc = subprocess.Popen([MOLT, "run", str(config), "--set", "logging.progress=lines"], cwd=ROOT, stdout=log,
                            stderr=subprocess.STDOUT)  # fmt: skip
    try:
        proc.wait(timeout=budget)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=300)
    log.close()
    if proc.returncode != 0:  # the run's output and logs may not outlive the machine: print their ends
        from molt_hpc.log import log_tail

        for path in [root / f"{name}.out", *sorted((root / name / "logs").glob("*.log"))]:
            print(f"== {path}:\n{log_tail(path, 30)}", flush=True)
        raise SystemExit(f"{name}: molt-hpc run exited {proc.returncode}; its output and logs are above")
    return launched


def steps_of(run_dir: Path) -> list[dict]:
    from molt_hpc.log import read_metrics

    return [r for r in read_metrics(run_dir / "metrics.jsonl", source="actor") if "step" in r]


def q8(args) -> None:
    config = q8_config(args)
    name = config.stem
    plan = planned_gib(config)
    gpu = GpuMemory()
    launched = launch(config, args.root, name, args.budget)
    peak = gpu.stop()
    steps = steps_of(args.root / name)
    rate = (len(steps) - 1) / (steps[-1]["time"] - steps[0]["time"]) * 60 if len(steps) > 1 else float("nan")
    refits = [r["refit_s"] for r in steps if r.get("refit_s") is not None]
    reserved = max((r.get("mem_peak_reserved_gb") or 0 for r in steps), default=0.0)
    row = {"arm": name, "plan_gib": plan, "peak_gib": peak, "steps": len(steps), "steps_per_min": rate,
           "first_step_s": steps[0]["time"] - launched if steps else None, "refit_s": refits,
           "trainer_reserved_gib": reserved * 1e9 / 2**30}  # fmt: skip
    (args.root / f"{name}.json").write_text(json.dumps(row))
    print(json.dumps(row), flush=True)
    if not steps:  # the row says what was measured (plan, peak); the rates need steps
        raise SystemExit(f"{name}: no step finished within --budget {args.budget:g} s; raise --budget")


def smol(args) -> None:
    from molt_hpc.config import load_config, to_toml

    name = f"smol-{args.mode}"
    sets = [f"run.root='{args.root}'", f"run.name='{name}'", "run.steps=100000", "eval.every=20",
            "checkpoint.interval=20", *args.overrides]  # fmt: skip
    cfg = load_config(ROOT / "configs" / "smollm2_gym_gpu.toml", sets)
    assert (cfg.actor.lora is not None) == (args.mode == "lora"), "--mode lora takes its adapters from --set"
    config = args.root / f"{name}.toml"
    config.write_text(to_toml(cfg))
    print(f"{name}: configs/smollm2_gym_gpu.toml for {args.budget:g} s, --set {sets}", flush=True)
    launched = launch(config, args.root, name, args.budget)
    (args.root / f"{name}.json").write_text(json.dumps({"arm": name, "launched": launched, "budget": args.budget}))


def report(args) -> None:
    from molt_hpc.log import read_metrics

    print("| run | plan GiB | GPU peak GiB | peak / plan | steps | steps/min | refit s (median) |")
    print("|---|---|---|---|---|---|---|")
    for path in sorted(args.root.glob("q8-*.json")):
        r = json.loads(path.read_text())
        refit = statistics.median(r["refit_s"]) if r["refit_s"] else float("nan")
        print(f"| {r['arm']} | {r['plan_gib']:.1f} | {r['peak_gib']:.1f} | {r['peak_gib'] / r['plan_gib']:.2f} | "
              f"{r['steps']} | {r['steps_per_min']:.2f} | {refit:.3f} |")  # fmt: skip
    for path in sorted(args.root.glob("smol-*.json")):
        meta, run_dir = json.loads(path.read_text()), args.root / path.stem
        steps = [s for s in steps_of(run_dir) if s["time"] - meta["launched"] <= meta["budget"]]
        rewards = [s["reward"] for s in steps]
        quarter = rewards[len(rewards) - max(1, len(rewards) // 4) :]
        print(f"{meta['arm']}: {len(steps)} steps in {meta['budget']:g} s, training reward first/last quarter "
              f"{statistics.fmean(rewards[: len(quarter)]):.3f} / {statistics.fmean(quarter):.3f}")  # fmt: skip
        for e in read_metrics(run_dir / "metrics.jsonl", source="eval"):
            print(f"  eval version {e['eval_version']:>4} at {e['time'] - meta['launched']:6.0f} s: "
                  f"pass@1 {e.get('eval_pass@1')}, pass@8 {e.get('eval_pass@8')}")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arm", choices=("model", "q8", "smol", "report"), required=True)
    p.add_argument("--root", type=Path, default=ROOT / "runs" / "lora-gpu")
    p.add_argument("--tokenizer", type=Path, help="--arm model: a directory with the tokenizer files")
    p.add_argument("--engine", choices=("builtin", "vllm"), default="builtin")
    p.add_argument("--mode", choices=("lora", "full"), default="lora")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--budget", type=float, default=540.0, help="seconds from launch before the run is stopped")
    p.add_argument("--set", action="append", default=[], dest="overrides", metavar="KEY=VALUE")
    p.add_argument("--tag", default="", help="--arm q8: a suffix of the run's name, two runs of one mode and engine")
    args = p.parse_args()
    args.root = args.root.absolute()
    args.root.mkdir(parents=True, exist_ok=True)
    {"model": lambda: write_model(args.root, args.tokenizer), "q8": lambda: q8(args), "smol": lambda: smol(args),
     "report": lambda: report(args)}[args.arm]()  # fmt: skip


if __name__ == "__main__":
    main()
