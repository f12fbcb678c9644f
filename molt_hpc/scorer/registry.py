"""Where the scoring processes are: each registers `RUN_DIR/rendezvous/<role>-<index>.json` once it listens
(`scorer-<i>` a reward-model scorer, `teacher-<i>` a distillation teacher); the orchestrator's client reads
the URLs back."""

import json
import os
from pathlib import Path
from typing import Literal

from molt_hpc.rundir import RunDir, atomic_write

Role = Literal["scorer", "teacher"]


def scorer_file(run: RunDir, index: int, role: Role = "scorer") -> Path:
    return run.rendezvous / f"{role}-{index}.json"


def register_scorer(run: RunDir, index: int, url: str, kind: str, role: Role = "scorer") -> None:
    record = {"url": url, "index": index, "pid": os.getpid(), "kind": kind}
    atomic_write(scorer_file(run, index, role), json.dumps(record))


def scorer_urls(run: RunDir, role: Role = "scorer") -> list[str]:
    """URLs of the registered processes of `role`, by index (a file being replaced is skipped until the next look)."""
    out = []
    for path in sorted(run.rendezvous.glob(f"{role}-*.json")):
        try:
            out.append(str(json.loads(path.read_text())["url"]))
        except (FileNotFoundError, json.JSONDecodeError, KeyError):
            continue
    return out
