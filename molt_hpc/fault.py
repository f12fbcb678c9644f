"""Why a run stopped on its own: the first fatal cause, recorded once in `RUN_DIR/control/failed`.

Any process may find that the run cannot go on — a circuit breaker of the orchestrator (groups
failing in a row, engines never healthy), the engine pool giving up on an engine, a config error
found at run time, the launcher's stall watch, the Slurm driver — and calls `fail(run_dir, reason)`.
The first reason wins (later ones are consequences), and `control/stop` asks the trainer to
checkpoint at its next step boundary. The launchers read the reason (`read_failure`) to stop the
run after that checkpoint with one line, never retrying it as a crash; `molt-hpc status` prints it.
A new start of the run clears it (`clear`).
"""

import contextlib
import json
import os
import time
from pathlib import Path

FAILED = "failed"
STOP = "stop"


def _control(run_dir: str | Path) -> Path:
    return Path(run_dir) / "control"


def fail(run_dir: str | Path, reason: str, source: str, *, config_error: bool = False) -> bool:
    """Record `reason` (one line) as why the run stops, unless a cause is already recorded; ask the
    trainer to checkpoint and stop. `config_error`: resuming with the same config cannot help.
    Returns whether this call recorded the cause."""
    control = _control(run_dir)
    control.mkdir(parents=True, exist_ok=True)
    line = " ".join(str(reason).split())  # one line, whatever the message held
    record = {"reason": line, "source": source, "time": time.time(), "config_error": config_error}
    tmp = control / f".{FAILED}.{os.getpid()}"
    tmp.write_text(json.dumps(record))
    try:
        os.link(tmp, control / FAILED)  # atomic and exclusive: the first cause stays
        first = True
    except FileExistsError:
        first = False
    finally:
        tmp.unlink(missing_ok=True)
    (control / STOP).touch()
    return first


def read_failure(run_dir: str | Path) -> dict | None:
    """The recorded cause (`reason`, `source`, `time`, `config_error`), or None."""
    with contextlib.suppress(FileNotFoundError, ValueError):
        return json.loads((_control(run_dir) / FAILED).read_text())
    return None


def clear(run_dir: str | Path) -> None:
    """Forget the cause of an earlier start (a resumed or resubmitted run starts clean)."""
    (_control(run_dir) / FAILED).unlink(missing_ok=True)
