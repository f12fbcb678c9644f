"""Logging for every process: one setup call, a role prefix, and the `metrics.jsonl` writer.

Each process calls `setup_logging("actor r0")` (or `engine 1`, `router`, ...) once; its lines read
`12:00:01 [actor r0] message`. Machine-readable records go to `metrics.jsonl`, one JSON object per
line, appended and flushed so a crash loses at most the line being written.
"""

import contextlib
import faulthandler
import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

LOGGER_NAME = "molt_hpc"


def setup_logging(
    role: str, level: str = "INFO", file: str | Path | None = None, quiet: bool = False
) -> logging.Logger:
    """Configure the process's logger with a `[role]` prefix, to stderr and optionally a file.

    `quiet` raises the stderr threshold to WARNING (non-zero trainer ranks) while the file, if
    any, still gets everything at `level`.
    """
    logger = logging.getLogger(LOGGER_NAME)
    logger.handlers.clear()
    logger.setLevel(level)
    logger.propagate = False
    fmt = logging.Formatter(f"%(asctime)s [{role}] %(message)s", datefmt="%H:%M:%S")
    stream = logging.StreamHandler(sys.stderr)
    stream.setFormatter(fmt)
    stream.setLevel("WARNING" if quiet else level)
    logger.addHandler(stream)
    if file is not None:
        Path(file).parent.mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(file)
        handler.setFormatter(fmt)
        logger.addHandler(handler)
    return logger


def get_logger() -> logging.Logger:
    return logging.getLogger(LOGGER_NAME)


def _clean(value: Any) -> Any:
    """JSON-safe scalars: tensors and numpy numbers become floats, NaN/inf become null."""
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


class MetricsWriter:
    """Appends one JSON object per call to a `metrics.jsonl`, stamped with time and source."""

    def __init__(self, path: str | Path, source: str):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.source = source
        self._file = open(self.path, "a", buffering=1)  # noqa: SIM115 - held for the process's life

    def write(self, record: dict[str, Any]) -> None:
        line = {"time": round(time.time(), 3), "source": self.source, **_clean(record)}
        self._file.write(json.dumps(line, separators=(",", ":")) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_metrics(path: str | Path, source: str | None = None) -> list[dict[str, Any]]:
    """Every record of a `metrics.jsonl` (optionally one source's); a torn last line is skipped."""
    records = []
    p = Path(path)
    if not p.exists():
        return records
    for line in p.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if source is None or rec.get("source") == source:
            records.append(rec)
    return records


def training_steps(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The trainer's step records of the run's current history, one per step, in step order.

    A run resumed after a crash re-trains the steps after its last checkpoint, so `metrics.jsonl` holds
    records of an abandoned history too. A record for step `s` supersedes every earlier record of step
    `s` or later: what remains is the history the checkpoints continue (the last record of each step).
    """
    kept: list[dict[str, Any]] = []
    for rec in records:
        step = rec.get("step")
        if step is None:
            continue
        while kept and kept[-1]["step"] >= step:
            kept.pop()
        kept.append(rec)
    return kept


def step_line(step: int, metrics: dict[str, Any]) -> str:
    """The fixed-format per-step log line: `step 12 | reward 0.410 | kl 0.0030 | ...`."""
    parts = [f"step {step}"]
    for key, fmt in (
        ("reward", ".3f"),
        ("reward_trained", ".3f"),
        ("sft_loss", ".4f"),
        ("rm_loss", ".4f"),
        ("rm_accuracy", ".3f"),
        ("eval_loss", ".4f"),
        ("eval_accuracy", ".3f"),
        ("kl", ".4f"),
        ("kl_rollout", ".4f"),
        ("distill/reverse_kl", ".4f"),
        ("distill/topk_kl", ".4f"),
        ("entropy", ".3f"),
        ("grad_norm", ".3f"),
        ("routing_agreement", ".3f"),
        ("refit_s", ".2f"),
        ("tokens_per_s", ".0f"),
        ("distill/teacher_tokens_per_s", ".0f"),
        ("buffer_pending", "d"),
        ("env_errors", "d"),
        ("engine_errors", "d"),
    ):
        if metrics.get(key) is not None:
            label = key.replace("_per_s", "/s").replace("_errors", " errors")  # env errors, engine errors
            parts.append(f"{label} {format(metrics[key], fmt)}")
    if (shown := eval_text(metrics)) is not None:
        parts.append(shown)
    return " | ".join(parts)


def eval_text(record: dict[str, Any]) -> str | None:
    """The last held-out evaluation in a record (`[eval]`): `eval v10 pass@1 0.500 pass@8 0.750 reward 0.420`."""
    if record.get("eval_version") is None:
        return None
    parts = [f"eval v{record['eval_version']}"]
    for key, value in record.items():
        if key.startswith("eval_pass@") and value is not None:
            parts.append(f"{key[5:]} {value:.3f}")
    if record.get("eval_reward") is not None:
        parts.append(f"reward {record['eval_reward']:.3f}")
    return " ".join(parts)


def log_tail(path: str | Path, lines: int = 20) -> str:
    """The last `lines` lines of a log file (for an error message about the process that wrote it)."""
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log written)"


def interactive() -> bool:
    return sys.stderr.isatty() and os.environ.get("CI") is None


class StallReport:
    """Writes every thread's Python stack to stderr (the process log) when `beat()` has not been called
    for `seconds`, and again each `seconds` while the stall lasts. It runs in faulthandler's C thread, so
    it reports even a process frozen by code that holds the GIL (a runaway regular expression, a long C
    call), which no Python watchdog could; the process itself is left alone."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self._armed_at = -math.inf

    def beat(self) -> None:
        # Re-arming restarts faulthandler's thread: do it a few times per period, not on every loop turn.
        now = time.monotonic()
        if now - self._armed_at >= self.seconds / 4:
            faulthandler.dump_traceback_later(self.seconds, repeat=True, file=sys.stderr)
            self._armed_at = now

    def stop(self) -> None:
        faulthandler.cancel_dump_traceback_later()
        self._armed_at = -math.inf


def end_process(code: int) -> NoReturn:
    """Flush every log and leave with `code`, skipping the interpreter's teardown.

    Call it last, after the process's own ordered shutdown (process groups destroyed, stores closed,
    its threads joined). torch keeps C++ threads that a caller cannot join: a gloo group's
    `pt_gloo_runloop` and `gloo_tcp_loop` threads outlive `destroy_process_group()` once DTensor or
    FSDP2 has used the group (it stays referenced from C++). A C++ thread that needs the GIL while the
    interpreter finalizes (to release a tensor that has a Python object, say) is ended by
    `pthread_exit`, whose unwinding through a noexcept destructor calls `std::terminate`:
    `terminate called without an active exception`, SIGABRT, and a run that finished is reported as
    failed. Leaving here, with everything flushed, gives no such thread an interpreter to meet.
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed or broken pipe: nothing more can reach it
            stream.flush()
    os._exit(code)
