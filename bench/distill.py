"""On-policy distillation vs RL alone on the CPU, on the same wall-clock budget (`make distill-demo`).

1. The teacher: the 4-layer SFT model of `configs/tiny_sft.toml` (`molt-hpc sft`; reused when its run
   directory already holds the finished model), evaluated here on held-out prompts, sampled at temperature 1.
2. Distillation: `configs/tiny_distill_cpu.toml`, a fresh 2-layer student trained on the teacher's
   per-token signal alone (the env's reward is recorded, never trained on).
3. RL alone: `configs/tiny_cpu.toml`, the same fresh student trained on the env's reward (GRPO).

Each run starts from nothing (its run directory is removed first), runs alone on the machine, and is
stopped (Ctrl-C: it checkpoints and ends) `--budget` seconds after its launch, start-up included. Both
reward curves (the mean env reward of every finished sample per training step) go into one PNG, against
wall-clock time and against steps. The final reward of a run is the mean over the last `--windows`
windows of its steps (the last quarter of its steps within the budget); its standard error comes from
the scatter of those window means. The verdict calls a difference real only beyond three standard errors
of the difference.

    python bench/distill.py [--budget 150] [--root runs/distill-demo]
"""

import argparse
import json
import math
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from molt_hpc.log import read_metrics  # noqa: E402

MOLT = str(Path(sys.executable).parent / "molt-hpc")
ARMS = (
    ("distillation", "configs/tiny_distill_cpu.toml"),
    ("RL alone", "configs/tiny_cpu.toml"),
)


def teacher(root: Path) -> tuple[Path, float]:
    """The SFT teacher's run directory and the seconds its training took now (0: reused)."""
    from molt_hpc.checkpoint import latest_checkpoint, read_run_state
    from molt_hpc.config import load_config

    run_dir = root / "tiny-sft"
    steps = load_config(ROOT / "configs" / "tiny_sft.toml").run.steps
    latest = latest_checkpoint(run_dir / "checkpoints") if (run_dir / "checkpoints").is_dir() else None
    if latest is not None and read_run_state(latest)["step"] >= steps:
        print(f"teacher: reusing {run_dir} (delete it to train it again)", flush=True)
        return run_dir, 0.0
    shutil.rmtree(run_dir, ignore_errors=True)
    start = time.monotonic()
    cmd = [MOLT, "sft", "configs/tiny_sft.toml", "--set", f"run.root={root}", "--set", "logging.progress=lines"]
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return run_dir, time.monotonic() - start


def sampled_reward(model_dir: Path, rows: int = 256) -> float:
    """Mean env reward of the model on the first `rows` held-out prompts, one sample each at temperature 1."""
    import torch
    from transformers import AutoModelForCausalLM

    from molt_hpc.agents.grading import reverse_reward
    from molt_hpc.data import render_prompt
    from molt_hpc.models import load_tokenizer
    from molt_hpc.models.resolve import run_model

    path = run_model(model_dir, "policy")
    tok, model = load_tokenizer(path), AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval()
    end = tok.convert_tokens_to_ids("<|im_end|>")
    lines = (ROOT / "data" / "reverse_eval.jsonl").read_text().splitlines()[:rows]
    torch.manual_seed(0)
    total = 0.0
    with torch.no_grad():
        for line in lines:
            row = json.loads(line)
            ids = torch.tensor([render_prompt(tok, row["prompt"])])
            out = model.generate(ids, do_sample=True, temperature=1.0, top_k=0, max_new_tokens=6, eos_token_id=end,
                                 pad_token_id=tok.pad_token_id)  # fmt: skip
            total += reverse_reward(tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True), str(row["label"]))
    return total / len(lines)


def run_arm(name: str, config: str, root: Path, budget: float, sets: list[str]) -> tuple[Path, list[dict]]:
    """One run from nothing, stopped `budget` seconds after its launch; its training records within the budget,
    each with `elapsed` (seconds since the launch)."""
    run_name = "distill" if name == "distillation" else "rl"
    run_dir = root / run_name
    shutil.rmtree(run_dir, ignore_errors=True)
    sets = [f"run.root={root}", f"run.name={run_name}", "run.steps=100000", "logging.progress=lines", *sets]
    log = open(root / f"{run_name}.out", "w")  # noqa: SIM115 (the run writes it until it ends)
    launched = time.time()
    proc = subprocess.Popen([MOLT, "run", config, *(a for s in sets for a in ("--set", s))], cwd=ROOT,
                            stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        proc.wait(timeout=budget)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)  # it checkpoints at the next step boundary and ends
        proc.wait(timeout=300)
    log.close()
    if proc.returncode != 0:
        raise SystemExit(f"{name}: molt-hpc run exited {proc.returncode}; see {root / f'{run_name}.out'}")
    records = [r for r in read_metrics(run_dir / "metrics.jsonl", source="actor") if "step" in r]
    for r in records:
        r["elapsed"] = r["time"] - launched
    return run_dir, [r for r in records if r["elapsed"] <= budget]


def final(records: list[dict], windows: int) -> tuple[float, float, int]:
    """(mean reward over the last quarter of the steps, its standard error from `windows` window means, steps)."""
    rewards = [r["reward"] for r in records]
    tail = rewards[len(rewards) - len(rewards) // 4 :]
    size = len(tail) // windows
    if size < 2:
        raise SystemExit(f"only {len(rewards)} steps within the budget: raise --budget")
    means = [statistics.fmean(tail[len(tail) - (k + 1) * size : len(tail) - k * size]) for k in range(windows)]
    return statistics.fmean(means), statistics.stdev(means) / math.sqrt(windows), len(rewards)


def plot(results: dict[str, list[dict]], out: Path, teacher_reward: float, budget: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for (name, records), colour in zip(results.items(), ("tab:blue", "tab:orange"), strict=True):
        rewards = [r["reward"] for r in records]
        smooth = [statistics.fmean(rewards[max(0, i - 9) : i + 1]) for i in range(len(rewards))]
        for ax, xs in zip(axes, ([r["elapsed"] / 60 for r in records], [r["step"] for r in records]), strict=True):
            ax.plot(xs, rewards, color=colour, alpha=0.25, linewidth=0.8)
            ax.plot(xs, smooth, color=colour, linewidth=1.8, label=f"{name} (mean of 10 steps)")
    for ax, xlabel in zip(axes, ("wall-clock minutes since launch (start-up included)", "training step"), strict=True):
        ax.axhline(teacher_reward, color="grey", linestyle="--", linewidth=1, label="teacher (SFT, 4 layers)")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("env reward (every finished sample)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    axes[0].set_xlim(0, budget / 60)
    fig.suptitle(f"tiny reverse task, fresh 2-layer student: distillation vs RL alone, {budget:g} s each")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=150.0, help="seconds per run, from its launch")
    parser.add_argument("--root", type=Path, default=ROOT / "runs" / "distill-demo")
    parser.add_argument("--windows", type=int, default=4, help="windows the last quarter of steps is cut into")
    args = parser.parse_args()
    root = args.root.absolute()
    root.mkdir(parents=True, exist_ok=True)
    teacher_dir, sft_s = teacher(root)
    teacher_reward = sampled_reward(teacher_dir)
    print(f"teacher: {teacher_dir} (SFT {sft_s:.0f} s), reward {teacher_reward:.3f} on 256 held-out prompts",
          flush=True)  # fmt: skip
    results = {}
    for name, config in ARMS:
        sets = [f"distill.teacher={teacher_dir}"] if name == "distillation" else []
        print(f"{name}: {config} for {args.budget:g} s ...", flush=True)
        _, results[name] = run_arm(name, config, root, args.budget, sets)
    report(results, args, teacher_reward, root)


def report(results: dict[str, list[dict]], args, teacher_reward: float, root: Path) -> None:
    png = root / "distill_vs_rl.png"
    plot(results, png, teacher_reward, args.budget)
    stats = {name: final(records, args.windows) for name, records in results.items()}
    for name, (mean, se, steps) in stats.items():
        extra = ""
        if name == "distillation":
            kl = [r["distill/reverse_kl"] for r in results[name][-len(results[name]) // 4 :]]
            extra = f", reverse KL {statistics.fmean(kl):.3f} nats/token over the last quarter"
        print(f"{name}: {steps} steps in {args.budget:g} s; final reward {mean:.3f} ± {se:.3f} (standard error "
              f"over {args.windows} windows of the last quarter){extra}")  # fmt: skip
    (d, d_se, _), (r, r_se, _) = stats["distillation"], stats["RL alone"]
    noise = 3 * math.hypot(d_se, r_se)
    verdict = "beyond" if abs(d - r) > noise else "within"
    print(f"distillation - RL alone = {d - r:+.3f}; three standard errors of the difference = {noise:.3f}: {verdict} "
          "the noise")  # fmt: skip
    print(f"plot: {png}")


if __name__ == "__main__":
    main()
