"""Experiment trackers: Weights & Biases and TensorBoard, fed with exactly what `metrics.jsonl` gets.

One process per run follows `metrics.jsonl` (the local launcher; on Slurm the driver) and forwards
every record, from every source (trainer, rollout, evaluation, launcher), so the trackers show the
same numbers as `status` and `plot`. Keys become `<source>/<key>`; the trainer's series are drawn
against `actor/step`, the held-out evaluations' (`eval/eval_pass@1`, ...) against `eval/eval_version`
(the policy version evaluated, which is the step that made it), the others against `<source>/time_s`
(seconds since the run's first record).

A resumed run (`--resume`, a Slurm requeue) continues the same W&B run: its id and the time of the
last forwarded record live in `trackers.json` in the run directory, so nothing is sent twice and
nothing is skipped.
"""

import json
import math
import os
import secrets
import socket
import urllib.parse
from pathlib import Path
from typing import Any

from molt_hpc.config import MoltConfig
from molt_hpc.config.infra import LoggingConfig, WandbConfig
from molt_hpc.log import get_logger
from molt_hpc.records import MetricsTail
from molt_hpc.rundir import RunDir, atomic_write

STATE_FILE = "trackers.json"
STEP_KEYS = {"actor": "step", "eval": "eval_version"}
"""The x-axis of each source's series (the others: seconds since the run's first record)."""
INSTALL = {"wandb": "pip install 'molt-hpc[wandb]'", "tensorboard": "pip install 'molt-hpc[tensorboard]'"}


def check_trackers(cfg: LoggingConfig) -> None:
    """A clear error before anything starts when a configured tracker's package is missing."""
    import importlib.util

    for name, section in (("wandb", cfg.wandb), ("tensorboard", cfg.tensorboard)):
        if section is not None and importlib.util.find_spec(name) is None:
            raise ValueError(f"logging.{name} is set but the {name} package is missing; install it: {INSTALL[name]}")


def check_optional_packages(cfg: MoltConfig) -> None:
    """Every optional package the config asks for is installed (trackers, vLLM's router)."""
    check_trackers(cfg.logging)
    if cfg.router.kind == "vllm-router":
        from molt_hpc.router.vllm_router import router_binary

        router_binary()


class Trackers:
    """Forwards new `metrics.jsonl` records to the configured trackers; `update()` often, `close()` once."""

    def __init__(self, cfg: LoggingConfig, run: RunDir, run_name: str):
        check_trackers(cfg)
        self.run = run
        self.state = _read_state(run.path / STATE_FILE)
        self._tail = MetricsTail(run.metrics)
        self.sinks: list[Any] = []
        if cfg.wandb is not None:
            self.sinks.append(WandbSink(cfg.wandb, run, run_name, self.state))
        if cfg.tensorboard is not None:
            tb_dir = Path(cfg.tensorboard.dir) if cfg.tensorboard.dir else run.path / "tensorboard"
            self.sinks.append(TensorBoardSink(tb_dir))
        self._save()

    def update(self) -> int:
        """Forward the records written since the last call; returns how many."""
        if not self.sinks:
            return 0
        sent = 0
        seen_at_last = 0  # records met at `last_time` in this pass; the first `at_last` were forwarded before
        for rec in self._tail.new():
            t = rec.get("time")
            last = self.state.get("last_time", -math.inf)
            if not isinstance(t, int | float) or t < last:
                continue  # forwarded before a resume, or not a metrics record
            if t == last:  # several records share a millisecond: skip only those already forwarded
                seen_at_last += 1
                if seen_at_last <= self.state.get("at_last", 0):
                    continue
            self.state.setdefault("t0", t)
            source = str(rec.get("source", "run"))
            values = {f"{source}/{k}": float(v) for k, v in rec.items() if _is_number(v) and k not in ("time",)}
            step_key = STEP_KEYS.get(source)
            step = int(rec[step_key]) if step_key and _is_number(rec.get(step_key)) else None
            values[f"{source}/time_s"] = round(t - self.state["t0"], 3)
            for sink in self.sinks:
                sink.log(source, values, step)
            self.state["at_last"] = self.state.get("at_last", 0) + 1 if t == last else 1
            self.state["last_time"] = t
            seen_at_last = self.state["at_last"]
            sent += 1
        if sent:
            self._save()
        return sent

    def close(self) -> None:
        self.update()
        for sink in self.sinks:
            sink.close()
        self.sinks = []

    def _save(self) -> None:
        atomic_write(self.run.path / STATE_FILE, json.dumps(self.state))


class WandbSink:
    """One W&B run per molt-hpc run, resumed by id."""

    def __init__(self, cfg: WandbConfig, run: RunDir, run_name: str, state: dict[str, Any]):
        import wandb

        mode = cfg.mode if cfg.mode != "auto" else wandb_mode()
        if "wandb_id" not in state:
            state["wandb_id"] = secrets.token_hex(4)  # W&B run ids: short, [a-z0-9]
        self.wandb = wandb
        self.run = wandb.init(
            project=cfg.project,
            entity=cfg.entity,
            name=cfg.name or run_name,
            tags=cfg.tags or None,
            id=state["wandb_id"],
            resume="allow",
            dir=str(run.path),
            mode=mode,
            config=_config(run),
            settings=wandb.Settings(console="off", silent=True),
        )
        self.sources: set[str] = set()
        where = f"{run.path}/wandb" if mode == "offline" else self.run.url
        get_logger().info("W&B run %s (%s): %s", state["wandb_id"], mode, where)
        if mode == "offline":
            get_logger().info("upload it later with: wandb sync %s/wandb/offline-run-*", run.path)

    def log(self, source: str, values: dict[str, float], step: int | None) -> None:
        if source not in self.sources:  # each source's series against its own x-axis
            axis = f"{source}/{STEP_KEYS[source]}" if source in STEP_KEYS else f"{source}/time_s"
            self.run.define_metric(axis)
            self.run.define_metric(f"{source}/*", step_metric=axis)
            self.sources.add(source)
        self.run.log(values)

    def close(self) -> None:
        self.run.finish()
        # finish() returns before W&B's service process has written the run's last records (seen
        # offline under load); tearing the service down waits for it, so the files are whole.
        self.wandb.teardown()


class TensorBoardSink:
    """Scalars in TensorBoard event files; the trainer's at its step, the evaluations' at the version they
    evaluate, the others at whole seconds."""

    def __init__(self, log_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        log_dir.mkdir(parents=True, exist_ok=True)
        self.writer = SummaryWriter(log_dir=str(log_dir))
        get_logger().info("TensorBoard event files in %s (tensorboard --logdir %s)", log_dir, log_dir)

    def log(self, source: str, values: dict[str, float], step: int | None) -> None:
        at = step if step is not None else int(values[f"{source}/time_s"])
        for key, value in values.items():
            self.writer.add_scalar(key, value, global_step=at)

    def close(self) -> None:
        self.writer.close()


def wandb_mode() -> str:
    """`online` when W&B credentials exist and its server answers within 3 s, else `offline`."""
    base = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")
    host = urllib.parse.urlparse(base).hostname or "api.wandb.ai"
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    has_key = bool(os.environ.get("WANDB_API_KEY")) or (netrc.is_file() and host in netrc.read_text(errors="ignore"))
    if not has_key:
        get_logger().info("no W&B credentials (WANDB_API_KEY or `wandb login`): logging offline")
        return "offline"
    port = urllib.parse.urlparse(base).port or (443 if base.startswith("https") else 80)
    try:
        socket.create_connection((host, port), timeout=3).close()
    except OSError:
        get_logger().info("%s does not answer: logging offline", host)
        return "offline"
    return "online"


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _read_state(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def _config(run: RunDir) -> dict[str, Any]:
    """The resolved config that ran, as W&B's run config."""
    import tomllib

    try:
        return tomllib.loads((run.path / "config.toml").read_text())
    except (FileNotFoundError, tomllib.TOMLDecodeError):
        return {}
