"""Chat mode vs env mode in training: the same task (reverse a string, the tiny config), the same seed.

Each mode runs `molt-hpc run configs/tiny_cpu.toml` for `--steps` steps, asynchronous (buffer.max_staleness
2): env mode with `envs/reverse.py`, chat mode with `envs/reverse_chat.py` (the `openai` client against the
chat endpoint). From each run's `metrics.jsonl`: `kl_rollout` (k3 of the engine's log-probs against the
trainer's over the trained tokens: the distance the off-policy correction spans), the train/inference
mismatch on same-version tokens, the share of groups trained from older weights, the trainer's tokens/s,
the rollout's generated tokens/s, steps per minute and the reward's first and last quarter. Modes alternate
over `--repeats` rounds; the table shows medians over rounds (per-step values: mean over steps 2..N).

`--task calculator` runs the multi-turn tool task instead (`configs/tiny_calculator_chat_cpu.toml`): env mode
with `envs/calculator.py` (`<calc>` turns, `rollout.max_turns = 4`), chat mode with `envs/calculator_chat.py`
(the calculator as an OpenAI tool, `tools=[...]` and `tool` messages). `--seconds` stops each run that long
after its launch (start-up included) instead of after `--steps`, so both modes get the same time.

    python bench/chat_train.py [--steps 30] [--repeats 2]
    python bench/chat_train.py --task calculator --seconds 120 --repeats 2
    python bench/chat_train.py --task calculator --seconds 120 --set model.path=runs/tiny-calculator-sft

The last starts both modes from the model `molt-hpc sft configs/tiny_calculator_sft.toml` writes, which calls
the calculator in either form (the untrained tiny model calls none, so neither mode has anything to learn).
"""

import argparse
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from molt_hpc.log import read_metrics  # noqa: E402

TASKS = {
    "reverse": ("configs/tiny_cpu.toml", {"env mode": "envs/reverse.py", "chat mode": "envs/reverse_chat.py"}, []),
    "calculator": (
        "configs/tiny_calculator_chat_cpu.toml",
        {"env mode": "envs/calculator.py", "chat mode": "envs/calculator_chat.py"},
        ["rollout.max_turns=4"],
    ),
}


def launch(config: str, agent: str, root: str, steps: int, seconds: float | None, sets: list[str]) -> None:
    """One `molt-hpc run` of `agent`: to `steps` steps, or stopped (SIGINT: it ends at a step boundary) `seconds`
    after its launch."""
    sets = [f"run.root={root}", "run.name=bench", f"run.steps={steps if seconds is None else 100_000}",
            f'rollout.agent="{agent}"', "checkpoint.interval=0", "logging.progress=lines", *sets]  # fmt: skip
    cmd = [str(Path(sys.executable).parent / "molt-hpc"), "run", config, *(a for s in sets for a in ("--set", s))]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _, err = proc.communicate(timeout=seconds)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=300)
    if proc.returncode:
        raise SystemExit(f"molt-hpc run {config} with {agent} exited {proc.returncode}:\n{err[-3000:]}")


def one_run(config: str, agent: str, steps: int, seconds: float | None, sets: list[str]) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="molt-bench-") as root:
        launch(config, agent, root, steps, seconds, sets)
        records = read_metrics(Path(root) / "bench" / "metrics.jsonl")
    actor = [r for r in records if r["source"] == "actor"]
    rollout = [r for r in records if r["source"] == "rollout" and r.get("tokens_per_s")]
    later = actor[1:]  # step 1 trains on version-0 rollouts only
    groups = [sum(r["staleness"].values()) for r in later]
    stale = [sum(n for k, n in r["staleness"].items() if k != "0") for r in later]
    q = max(1, len(actor) // 4)
    span = actor[-1]["time"] - actor[0]["time"]
    return {
        "kl_rollout": statistics.fmean(r["kl_rollout"] for r in later),
        "kl_rollout_max": max(r["kl_rollout"] for r in later),
        "mismatch": statistics.fmean(r["mismatch_abs_mean"] for r in later if "mismatch_abs_mean" in r),
        "stale_share": sum(stale) / sum(groups),
        "train_tok_s": statistics.median(r["tokens_per_s"] for r in later),
        "rollout_tok_s": statistics.median(r["tokens_per_s"] for r in rollout),
        "steps": len(actor),
        "steps_min": (len(actor) - 1) / span * 60,
        "turns": statistics.median(r.get("turns_mean", 1.0) for r in rollout),
        "reward_first": statistics.fmean(r["reward"] for r in actor[:q]),
        "reward_last": statistics.fmean(r["reward"] for r in actor[-q:]),
    }


COLUMNS = [
    ("kl_rollout", "kl_rollout", ".4f"), ("kl_rollout_max", "max", ".4f"), ("mismatch", "mismatch |d|", ".1e"),
    ("stale_share", "stale groups", ".2f"), ("train_tok_s", "train tok/s", ".0f"),
    ("rollout_tok_s", "rollout tok/s", ".0f"), ("steps", "steps", ".0f"),
    ("steps_min", "steps/min", ".1f"), ("turns", "turns/episode", ".2f"),
    ("reward_first", "reward q1", ".3f"), ("reward_last", "reward q4", ".3f"),
]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--task", choices=sorted(TASKS), default="reverse")
    parser.add_argument("--seconds", type=float, help="stop each run this long after its launch instead")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for both modes' runs (repeatable)")  # fmt: skip
    args = parser.parse_args()
    config, agents, sets = TASKS[args.task]
    sets = [*sets, *args.sets]
    results: dict[str, list[dict[str, float]]] = {name: [] for name in agents}
    for _ in range(args.repeats):
        for name, agent in agents.items():
            results[name].append(one_run(config, agent, args.steps, args.seconds, sets))
    length = f"{args.seconds:g} s" if args.seconds else f"{args.steps} steps"
    print(f"{config}, {args.task} task, {length} per run, median of {args.repeats} alternating runs")
    print("overrides: " + " ".join(sets) if sets else "no overrides")
    print("| mode | " + " | ".join(title for _, title, _ in COLUMNS) + " |")
    print("|---" * (len(COLUMNS) + 1) + "|")
    for name, runs in results.items():
        med = {key: statistics.median(r[key] for r in runs) for key, _, _ in COLUMNS}
        print(f"| {name} | " + " | ".join(f"{med[key]:{fmt}}" for key, _, fmt in COLUMNS) + " |")


if __name__ == "__main__":
    main()
