"""Scoring processes of the engine pool, called once per finished group, never in the router's ring or the
refit group (their weights are frozen), restarted by the pool like an engine when they die. Two roles:

- reward-model scorers (`[reward_model]`): vLLM's classify API, `POST /classify` with `{"input": [[token
  ids], ...], "use_activation": false}` answers `{"data": [{"index": i, "probs": [score], ...}]}`;
  registered as `RUN_DIR/rendezvous/scorer-<index>.json`;
- distillation teachers (`[distill]`): `POST /logprobs` with token ids and the spans to score answers the
  teacher's log-prob of each token in them (and, with `top_k`, its top tokens at each of their positions),
  whichever kind serves it; registered as `RUN_DIR/rendezvous/teacher-<index>.json`.

`GET /health` answers `{"status": "ok", ...}`; every route needs the run's token. A process registers
(`url`, `index`, `pid`, `kind`) once it listens and removes its file on a clean stop.

builtin.py  the transformers scorer (`reward_model.kind = "builtin"`), CPU or GPU: `main(cfg, run_dir, index)`;
            `listen`, the serving and registration every built-in process of this package shares
vllm.py     `vllm serve` as a pooling (classify) model behind a token-checking front (`kind = "vllm"`)
teacher.py  the distillation teacher (`distill.kind = "builtin"`): a causal LM's log-probs of given tokens
teacher_vllm.py  `vllm serve` of the teacher behind a front that speaks the same `/logprobs` (`kind = "vllm"`)
request.py  the typed bodies of both routes
registry.py where a process registers its URL in the run directory, by role, and who reads it
client.py   the orchestrator's side: a group's sequences scored, waiting (and retrying) while none of the role answers
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


def teacher_main(cfg, run_dir: str | Path, index: int) -> int:
    """Run teacher `index` of the run in `run_dir` (the kind `distill.kind` names) until SIGTERM."""
    if cfg.distill is None:
        raise ValueError("this run has no [distill]; a teacher needs distill.teacher")
    if cfg.distill.kind == "vllm":
        from molt_hpc.scorer.teacher_vllm import main as run
    else:
        from molt_hpc.scorer.teacher import main as run
    return run(cfg, run_dir, index)
