"""Reading a run's records (`metrics.jsonl`) as they grow, and the summaries several readers print: the
launcher's closing lines, `molt-hpc status` and the progress display. A leaf: it reads files and formats
lines, and imports no process code.
"""

import json
from pathlib import Path

from molt_hpc.log import read_metrics


class MetricsTail:
    """The records appended to a metrics file since the last `new()` (from byte `offset` at first)."""

    def __init__(self, path: Path, offset: int = 0):
        self.path, self.offset = path, offset

    def new(self) -> list[dict]:
        if not self.path.exists():
            return []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            chunk = f.read()
        end = chunk.rfind(b"\n") + 1  # a line still being written waits for the next call
        self.offset += end
        out = []
        for line in chunk[:end].splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:  # a torn line (a writer killed mid-line): the records after it count
                continue
        return out


NUMBERS = {"sft": ("eval_loss", "held-out loss"), "rm": ("eval_accuracy", "held-out pair accuracy")}


def stage_summary(run_dir: Path, stage: str) -> list[str]:
    """The stage's number, first evaluation → last, and the model directory a later stage takes."""
    records = [r for r in read_metrics(run_dir / "metrics.jsonl", source="actor") if "step" in r]
    key, what = NUMBERS[stage]
    evals = [r for r in records if r.get(key) is not None]
    lines = []
    if evals:
        first, last = evals[0], evals[-1]
        lines.append(
            f"{stage}: {what} {first[key]:.4f} (step {first['step']}) -> {last[key]:.4f} (step {last['step']})"
        )
    else:
        loss = [r[f"{stage}_loss"] for r in records if r.get(f"{stage}_loss") is not None]
        lines.append(f"{stage}: no held-out file; training loss {loss[0]:.4f} -> {loss[-1]:.4f}" if loss else
                     f"{stage}: no step recorded")  # fmt: skip
    part = "policy" if stage == "sft" else "reward"
    key_path = "model.path" if stage == "sft" else "reward_model.path"
    lines.append(
        f'{stage}: trained {part} model in {run_dir} (its latest checkpoint); use it as {key_path} = "{run_dir}"'
    )
    return lines


def eval_summary(run_dir: str | Path) -> str | None:
    """The held-out evaluations (`[eval]`): the first and the last, and the checkpoint `best` names."""
    from molt_hpc.checkpoint import read_best
    from molt_hpc.log import eval_text

    evals = read_metrics(Path(run_dir) / "metrics.jsonl", source="eval")
    if not evals:
        return None
    line = f"{eval_text(evals[-1])} ({len(evals)} evaluations; first: {eval_text(evals[0])})"
    best = read_best(Path(run_dir) / "checkpoints")
    if best is not None:
        line += f"; best: {best['checkpoint']} ({best['metric']} {best['value']:.3f})"
    return line


def rollout_rate(rollout: list[dict], until: float | None, windows: int = 10) -> tuple[float, float, int] | None:
    """(accepted groups/s, generated tokens/s, windows counted) over the last `windows` rollout records that
    ended by `until` (the last training step's time): a finished run's trailing window (its final
    evaluation, the wind-down) is not the rollout's rate."""
    done = [r for r in rollout if r.get("window_s") and (until is None or r["time"] <= until + 1e-6)]
    done = done[-windows:]
    seconds = sum(r["window_s"] for r in done)
    if not done or seconds <= 0:
        return None
    groups = sum(r.get("groups_per_s", 0.0) * r["window_s"] for r in done)
    tokens = sum(r.get("tokens_per_s", 0.0) * r["window_s"] for r in done)
    return groups / seconds, tokens / seconds, len(done)
