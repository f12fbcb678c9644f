"""Where the scorers are: each registers `RUN_DIR/rendezvous/scorer-<index>.json` once it listens; the
orchestrator's client reads the URLs back."""

import json
import os
from pathlib import Path

from molt_hpc.rundir import RunDir, atomic_write


def scorer_file(run: RunDir, index: int) -> Path:
    return run.rendezvous / f"scorer-{index}.json"


def register_scorer(run: RunDir, index: int, url: str, kind: str) -> None:
    atomic_write(scorer_file(run, index), json.dumps({"url": url, "index": index, "pid": os.getpid(), "kind": kind}))


def scorer_urls(run: RunDir) -> list[str]:
    """URLs of the registered scorers, by index (a file being replaced is skipped until the next look)."""
    out = []
    for path in sorted(run.rendezvous.glob("scorer-*.json")):
        try:
            out.append(str(json.loads(path.read_text())["url"]))
        except (FileNotFoundError, json.JSONDecodeError, KeyError):
            continue
    return out
