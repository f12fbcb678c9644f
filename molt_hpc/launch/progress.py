"""What an interactive or logged local run shows: a progress bar or one line per step, then a summary.

It follows the trainer's records in `metrics.jsonl` (source `actor`), so it shows exactly what the
machine-readable record holds; only records written after it started count, so a resumed run shows
its new steps, not the old ones again. The rollout's records add the env and engine error counts so
far to each step line, and a line of their own when groups fail while no step comes. Where no step
comes for a while, it says what the run is doing instead (`activity`): engines starting (a vLLM
engine loads for minutes) or a checkpoint being written, with the bytes so far.
"""

import contextlib
import time
from typing import Any

from molt_hpc.config import MoltConfig
from molt_hpc.log import interactive, step_line
from molt_hpc.records import MetricsTail
from molt_hpc.rundir import RunDir


class Progress:
    """Follows `metrics.jsonl` and renders new trainer steps."""

    def __init__(self, cfg: MoltConfig, run: RunDir, trackers: Any = None, start_step: int = 0):
        self.run = run
        self.trackers = trackers
        """`molt_hpc.trackers.Trackers` fed on every update (W&B, TensorBoard), or None."""
        self._last_shown = time.monotonic()
        self.engines = cfg.engines.count if cfg.run.stage == "rl" else 0  # a local run has one node; a stage none
        self.records: list[dict] = []
        start = run.metrics.stat().st_size if run.metrics.exists() else 0  # earlier starts' records: not again
        self._tail = MetricsTail(run.metrics, start)
        self.errors = {"env_errors": 0, "engine_errors": 0}
        """Env errors and engine failures the rollout reported since this start."""
        self._reported = dict(self.errors)
        self.last_eval: dict[str, Any] = {}
        """The last held-out evaluation's record (source `eval`), shown on every step line after it."""
        self.first_failure: str | None = None
        mode = cfg.logging.progress
        self.bar = None
        if mode == "bar" or (mode == "auto" and interactive()):
            from tqdm import tqdm

            self.bar = tqdm(total=cfg.run.steps, initial=start_step, desc="steps", unit="step", dynamic_ncols=True)

    def update(self) -> None:
        if self.trackers is not None:
            self.trackers.update()
        self._show_activity()
        stepped = False
        for rec in self._tail.new():
            if rec.get("source") == "rollout":
                self._count_errors(rec)
            if rec.get("source") == "eval":
                self.last_eval = {k: v for k, v in rec.items() if k.startswith("eval_")}
            if rec.get("source") != "actor" or "step" not in rec:
                continue
            stepped = True
            self.records.append(rec)
            self._last_shown = time.monotonic()
            shown = {**rec, **{k: v for k, v in self.errors.items() if v}, **self.last_eval}
            self._reported = dict(self.errors)
            if self.bar is not None:
                self.bar.n = rec["step"]
                self.bar.set_postfix_str(_postfix(shown), refresh=True)
            else:
                print(step_line(rec["step"], shown), flush=True)
        if not stepped and self.errors != self._reported:  # failures while no step comes: say so now
            self._reported = dict(self.errors)
            first = f"; first: {self.first_failure}" if self.first_failure else ""
            self._write(
                f"rollout: {self.errors['env_errors']} env errors, {self.errors['engine_errors']} engine errors{first}"
            )

    def _show_activity(self) -> None:
        """Every `ACTIVITY_S` without a new step: one line (or the bar's postfix) saying what happens."""
        now = time.monotonic()
        if now - self._last_shown < ACTIVITY_S:
            return
        what = activity(self.run, self.engines)
        if what is None:
            return
        self._last_shown = now
        if self.bar is not None:
            self.bar.set_postfix_str(what, refresh=True)
        else:
            print(what, flush=True)

    def _count_errors(self, rec: dict) -> None:
        self.errors["env_errors"] += sum(v for k, v in rec.items() if k.startswith("env_errors_"))
        self.errors["engine_errors"] += rec.get("samples_engine_retries", 0)
        if self.first_failure is None and rec.get("first_failure"):
            self.first_failure = rec["first_failure"]

    def _write(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def summary(self) -> None:
        from molt_hpc.log import read_metrics, training_steps
        from molt_hpc.plot import distill_summary, plot_run, reward_model_summary, reward_summary

        steps = training_steps(read_metrics(self.run.metrics, source="actor"))
        print(reward_summary(steps), flush=True)
        if (line := distill_summary(steps)) is not None:
            print(line, flush=True)
        for line in reward_model_summary(self.run):
            print(line, flush=True)
        from molt_hpc.records import eval_summary

        if (line := eval_summary(self.run.path)) is not None:
            print(line, flush=True)
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
        ("sft_loss", "loss", ".4f"),
        ("rm_loss", "loss", ".4f"),
        ("eval_loss", "eval loss", ".4f"),
        ("eval_accuracy", "eval accuracy", ".3f"),
        ("kl", "kl", ".4f"),
        ("kl_rollout", "kl(rollout)", ".4f"),
        ("distill/reverse_kl", "reverse kl", ".4f"),
        ("tokens_per_s", "tok/s", ".0f"),
        ("buffer_pending", "buffer", "d"),
        ("env_errors", "env errors", "d"),
        ("engine_errors", "engine errors", "d"),
    ):
        if rec.get(key) is not None:
            parts.append(f"{label} {format(rec[key], fmt)}")
    return ", ".join(parts)


ACTIVITY_S = 15.0


def activity(run: RunDir, engines: int) -> str | None:
    """What the run is busy with when no step is coming: a checkpoint being written, or start-up."""
    from molt_hpc.checkpoint import TMP_PREFIX

    for tmp in run.checkpoints.glob(f"{TMP_PREFIX}*"):
        written = 0
        for f in tmp.rglob("*"):
            with contextlib.suppress(OSError):  # published (renamed) while we count: the total is a sketch
                written += f.stat().st_size if f.is_file() else 0
        return f"writing checkpoint {tmp.name.removeprefix(TMP_PREFIX)}: {written / 1e9:.3g} GB so far"
    up = len(list(run.rendezvous.glob("engine-*.json")))
    if up < engines:
        return f"starting: {up}/{engines} engines up (a vLLM engine loads and compiles for minutes; see logs/)"
    return None
