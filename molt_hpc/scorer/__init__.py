"""Reward-model scorers: processes of the engine pool that score finished rollouts (`[reward_model]`).

A scorer serves one batched route, vLLM's classify API: `POST /classify` with
`{"input": [[token ids], ...], "use_activation": false}` answers `{"data": [{"index": i, "probs":
[score], ...}]}`; `GET /health` answers `{"status": "ok", ...}`. Every route needs the run's token.
It registers `RUN_DIR/rendezvous/scorer-<index>.json` (`url`, `index`, `pid`, `kind`) once it
listens and removes it on a clean stop; scorers are never in the router's ring or the refit group
(their weights are frozen). The pool restarts a dead one like an engine.

builtin.py  the transformers scorer (`reward_model.kind = "builtin"`), CPU or GPU: `main(cfg, run_dir, index)`
vllm.py     `vllm serve` as a pooling (classify) model behind a token-checking front (`kind = "vllm"`)
client.py   the orchestrator's side: score a group's sequences, waiting (and retrying) while no scorer answers
"""

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


def main(cfg, run_dir: str | Path, index: int) -> int:
    """Run scorer `index` of the run in `run_dir` (the kind `reward_model.kind` names) until SIGTERM."""
    if cfg.reward_model is None:
        raise ValueError("this run has no [reward_model]; a scorer needs reward_model.path")
    if cfg.reward_model.kind == "vllm":
        from molt_hpc.scorer.vllm import main as run
    else:
        from molt_hpc.scorer.builtin import main as run
    return run(cfg, run_dir, index)
