"""Pre-flight of `[distill]` in an RL run: the teacher is a model the run can load (checked like
`model.path`: a directory with a config, weights and a tokenizer, a run directory's latest policy, or a
builtin name), a causal LM and not a reward model, reads the policy's token ids (the same vocabulary, and
the same ids for the first prompts of the run), and the agent records the student's log-probs (env mode).
"""

from pathlib import Path
from typing import Any

from molt_hpc.config import MoltConfig
from molt_hpc.launch.preflight.files import PreflightError
from molt_hpc.launch.preflight.model import check_model

SAMPLE_PROMPTS = 64
"""Prompts rendered by both tokenizers: enough to meet every character of a typical prompt file."""
FIX = "name a teacher with the policy's tokenizer (a model trained from model.path, say)"


def check_distill_section(cfg: MoltConfig, original: MoltConfig, cwd: Path, tokenizer: Any, files: list) -> None:
    """The `[distill]` of an RL run can teach it (`files`: the prompt files' (key, as written, path))."""
    dist = cfg.distill
    if dist is None or cfg.run.stage != "rl":
        return
    from molt_hpc.models.teacher import teacher_model, tokenizer_mismatch

    written = original.distill.teacher  # type: ignore[union-attr]
    where = f"distill.teacher = {written!r}"
    teacher_cfg = cfg.model_copy(update={"model": teacher_model(cfg.model, dist.teacher)})
    teacher_tok, _ = check_model(teacher_cfg, written, cwd, key="distill.teacher")
    _check_causal(teacher_cfg, where)
    _check_env_mode(cfg)
    if teacher_tok is None or tokenizer is None:  # builtin:smollm2: its tokenizer comes with its conversion
        return
    pairs = _prompt_ids(cfg, teacher_tok, tokenizer, [path for _, _, path in files[:1]], where)
    if (why := tokenizer_mismatch(teacher_tok, tokenizer, pairs)) is not None:
        raise PreflightError(f"{where}: {why}; {FIX}")


def _check_causal(teacher_cfg: MoltConfig, where: str) -> None:
    if teacher_cfg.model.is_builtin:
        return
    from molt_hpc.models.resolve import run_model
    from molt_hpc.models.reward import is_reward_model

    path = run_model(Path(teacher_cfg.model.path), "policy")
    if is_reward_model(path):
        raise PreflightError(
            f"{where}: {path} is a reward model (a sequence classifier), not a causal LM; name the policy of a "
            "`molt-hpc run` or `molt-hpc sft` run, or an HF causal-LM directory"
        )


def _check_env_mode(cfg: MoltConfig) -> None:
    from molt_hpc.agents import ChatAgent
    from molt_hpc.agents.loader import load_agent

    if issubclass(load_agent(cfg.rollout.agent), ChatAgent):  # it loaded in check_agent already
        raise PreflightError(
            f"[distill] needs the student's log-prob of every sampled token, which a chat-mode agent "
            f"(rollout.agent = {cfg.rollout.agent!r}) does not record: write the agent as an Env"
        )


def _prompt_ids(cfg: MoltConfig, teacher: Any, policy: Any, paths: list[str], where: str) -> list:
    """(teacher's ids, policy's ids) of the first usable prompts of `paths`, each rendered as the run renders it."""
    from molt_hpc.data import row_problem, text_prompt_ids
    from molt_hpc.readers import iter_rows

    pairs: list[tuple[list[int], list[int]]] = []
    for path in paths:
        for _, row, problem in iter_rows(path):
            if len(pairs) >= SAMPLE_PROMPTS:
                break
            if problem is not None or row_problem(row, cfg.data) is not None:
                continue
            try:
                ids = text_prompt_ids(teacher, row, cfg.data)
            except Exception as err:  # the teacher's chat template: jinja and tokenizer errors of many types
                text = f"its tokenizer cannot render the run's prompts ({' '.join(str(err).split())})"
                raise PreflightError(f"{where}: {text}; {FIX}") from None
            pairs.append((ids, text_prompt_ids(policy, row, cfg.data)))
    return pairs
