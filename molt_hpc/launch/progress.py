"""What an interactive or logged local run shows: a progress bar or one line per step, then a summary.

It follows the trainer's records in `metrics.jsonl` (source `actor`), so it shows exactly what the
machine-readable record holds.
"""

import json

from molt_hpc.config import MoltConfig
from molt_hpc.log import interactive, step_line
from molt_hpc.rundir import RunDir


class Progress:
    """Follows `metrics.jsonl` and renders new trainer steps."""

    def __init__(self, cfg: MoltConfig, run: RunDir):
        self.run = run
        self.records: list[dict] = []
        self._offset = 0
        mode = cfg.logging.progress
        self.bar = None
        if mode == "bar" or (mode == "auto" and interactive()):
            from tqdm import tqdm

            self.bar = tqdm(total=cfg.run.steps, desc="steps", unit="step", dynamic_ncols=True)

    def update(self) -> None:
        for rec in self._new_records():
            if rec.get("source") != "actor" or "step" not in rec:
                continue
            self.records.append(rec)
            if self.bar is not None:
                self.bar.n = rec["step"]
                self.bar.set_postfix_str(_postfix(rec), refresh=True)
            else:
                print(step_line(rec["step"], rec), flush=True)

    def _new_records(self) -> list[dict]:
        path = self.run.metrics
        if not path.exists():
            return []
        with open(path, "rb") as f:
            f.seek(self._offset)
            chunk = f.read()
        end = chunk.rfind(b"\n") + 1  # a line still being written waits for the next call
        self._offset += end
        out = []
        for line in chunk[:end].splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return out

    def summary(self) -> None:
        from molt_hpc.plot import plot_run, reward_summary

        print(reward_summary(self.records), flush=True)
        png = plot_run(self.run.path)
        print(f"plot: {png}", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _postfix(rec: dict) -> str:
    parts = []
    for key, label, fmt in (
        ("reward", "reward", ".3f"),
        ("reward_trained", "trained", ".3f"),
        ("kl", "kl", ".4f"),
        ("kl_rollout", "kl(rollout)", ".4f"),
        ("tokens_per_s", "tok/s", ".0f"),
        ("buffer_pending", "buffer", "d"),
    ):
        if rec.get(key) is not None:
            parts.append(f"{label} {format(rec[key], fmt)}")
    return ", ".join(parts)
