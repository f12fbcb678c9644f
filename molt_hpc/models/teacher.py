"""A distillation teacher (`distill.teacher`): the directory it names, resolved like `model.path` (an HF
directory, a `builtin:` name built with the `[model]` section's spec, or a run directory's latest policy),
and whether it reads the policy's token ids as the policy wrote them (the same tokenizer).

The teacher scores the rollout's own token ids, never text: a teacher with another vocabulary, or one
that would cut the run's prompts into other ids, would score tokens it does not mean.
"""

from pathlib import Path
from typing import Any

from molt_hpc.config.model import ModelConfig


def teacher_model(model: ModelConfig, teacher: str) -> ModelConfig:
    """The `[model]` section with the teacher as its path (a builtin teacher takes the section's spec)."""
    return model.model_copy(update={"path": teacher})


def resolve_teacher(model: ModelConfig, teacher: str, cache_dir: str | Path) -> Path:
    """The teacher's HF causal-LM directory (a builtin one built once into `cache_dir`), checked."""
    from molt_hpc.models.resolve import resolve_model
    from molt_hpc.models.reward import is_reward_model

    path = resolve_model(teacher_model(model, teacher), cache_dir)
    if is_reward_model(path):
        raise ValueError(
            f"distill.teacher {path} is a reward model (a sequence classifier): a teacher is a causal LM; name "
            "the policy of a `molt-hpc run` or `molt-hpc sft` run, or an HF causal-LM directory"
        )
    return path


def tokenizer_mismatch(teacher: Any, policy: Any, prompts: list[tuple[list[int], list[int]]] = ()) -> str | None:
    """What differs between the teacher's tokenizer and the policy's (None: nothing): the vocabulary
    (token -> id), or the ids of one of the run's prompts, given as (teacher's ids, policy's ids) pairs."""
    tv, pv = teacher.get_vocab(), policy.get_vocab()
    if tv != pv:
        only = len(tv.keys() ^ pv.keys())
        moved = sum(1 for t, i in tv.items() if t in pv and pv[t] != i)
        sizes = f"{len(tv)} vs {len(pv)} tokens; {only} in one only, {moved} with other ids"
        return f"its vocabulary is not the policy's ({sizes})"
    for n, (a, b) in enumerate(prompts):
        if a != b:
            at = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            return f"it renders prompt {n} of the run into other ids (they part at token {at} of {len(b)})"
    return None
