"""Reward-model scorers: processes of the engine pool that score finished rollouts (`[reward_model]`).

A scorer serves one batched route, vLLM's classify API: `POST /classify` with
`{"input": [[token ids], ...], "use_activation": false}` answers `{"data": [{"index": i, "probs":
[score], ...}]}`; `GET /health` answers `{"status": "ok", ...}`. Every route needs the run's token.
It registers `RUN_DIR/rendezvous/scorer-<index>.json` (`url`, `index`, `pid`, `kind`) once it
listens and removes it on a clean stop; scorers are never in the router's ring or the refit group
(their weights are frozen). The pool restarts a dead one like an engine.

builtin.py  the transformers scorer (`reward_model.kind = "builtin"`), CPU or GPU: `main(cfg, run_dir, index)`
vllm.py     `vllm serve` as a pooling (classify) model behind a token-checking front (`kind = "vllm"`)
registry.py where a scorer registers its URL in the run directory, and who reads it
client.py   the orchestrator's side: score a group's sequences, waiting (and retrying) while no scorer answers
"""

from pathlib import Path


def main(cfg, run_dir: str | Path, index: int) -> int:
    """Run scorer `index` of the run in `run_dir` (the kind `reward_model.kind` names) until SIGTERM."""
    if cfg.reward_model is None:
        raise ValueError("this run has no [reward_model]; a scorer needs reward_model.path")
    if cfg.reward_model.kind == "vllm":
        from molt_hpc.scorer.vllm import main as run
    else:
        from molt_hpc.scorer.builtin import main as run
    return run(cfg, run_dir, index)
