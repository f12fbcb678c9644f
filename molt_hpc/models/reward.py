"""Reward models: a causal LM's backbone with a one-label sequence-classification head (`score`), whose
score of a sequence is the head's output at the sequence's last token.

A reward-model directory is an HF `…ForSequenceClassification` directory with `num_labels = 1` and
`problem_type = "regression"` (so vLLM's classify serving applies no activation to the score), which
`AutoModelForSequenceClassification.from_pretrained` loads as is. `molt-hpc rm train` writes the
held-out score statistics into its config (`molt_reward_mean`, `molt_reward_std`), which
`reward_model.normalize = "checkpoint"` uses.

Scores are always read at the last token of each sequence, never through transformers' own pooling
(the last token that is not the pad token), which misreads sequences ending in EOS when a model's pad
token is its EOS token; `token_scores` hooks the head to get its output at every position.
"""

import json
from pathlib import Path

from molt_hpc.hf_logging import quiet_transformers
from molt_hpc.models.load import check_model_dir

MEAN_KEY, STD_KEY = "molt_reward_mean", "molt_reward_std"


def is_reward_model(path: Path) -> bool:
    """Whether `path` holds a sequence-classification model (else it is a base to put a new head on)."""
    config = json.loads((Path(path) / "config.json").read_text())
    return any(a.endswith("ForSequenceClassification") for a in config.get("architectures") or [])


def load_reward_model(path: str | Path, *, dtype: str = "float32", attn: str = "sdpa", seed: int = 0, device="cpu"):
    """The reward model in `path` (a reward checkpoint), or a causal LM's backbone with a new score head
    initialised from `seed` (the same head at any rank count); on `device`, dropout untouched."""
    import torch
    from transformers import AutoModelForSequenceClassification

    quiet_transformers()
    check_model_dir(Path(path))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForSequenceClassification.from_pretrained(
            str(path), num_labels=1, dtype=getattr(torch, dtype), attn_implementation=attn, local_files_only=True
        )
    return reward_config(model).to(device)


def reward_config(model):
    """Make `model`'s config a reward model's (before any wrapping renames its class): its own
    architecture (vLLM serves by it, not by the base's), no activation on the score, a pad token."""
    config = model.config
    config.architectures = [type(model).__name__]
    config.problem_type = "regression"
    # transformers refuses batches without a pad id (our scores never read it)
    if getattr(config, "pad_token_id", None) is None:
        config.pad_token_id = config.eos_token_id if isinstance(config.eos_token_id, int) else 0
    return model


def token_scores(model, **inputs):
    """(`[B, T]` float32 score at every position, the model's output): position t scores the sequence
    that ends with token t. The output's pooled logits are returned so a caller can keep FSDP's hooks on it."""
    captured = []
    handle = model.score.register_forward_hook(lambda _m, _i, out: captured.append(out))
    try:
        out = model(**inputs)
    finally:
        handle.remove()
    return captured[-1][..., 0].float(), out


def score_sequences(model, sequences: list[list[int]], max_batch: int = 64) -> list[float]:
    """The score of each token sequence (a no-grad forward per `max_batch` sequences, right padded:
    causal attention keeps real tokens from seeing the padding after them)."""
    import torch

    device = next(model.parameters()).device
    out: list[float] = []
    with torch.no_grad():
        for i in range(0, len(sequences), max_batch):
            part = sequences[i : i + max_batch]
            width = max(len(s) for s in part)
            ids = torch.zeros((len(part), width), dtype=torch.long)
            for r, s in enumerate(part):
                ids[r, : len(s)] = torch.tensor(s, dtype=torch.long)
            scores, _ = token_scores(model, input_ids=ids.to(device), use_cache=False)
            last = torch.tensor([len(s) - 1 for s in part], device=scores.device)
            out += scores[torch.arange(len(part), device=scores.device), last].tolist()
    return out


def reward_stats(path: str | Path) -> tuple[float, float] | None:
    """(mean, std) of the held-out scores written by `molt-hpc rm train`, or None if absent."""
    config = json.loads((Path(path) / "config.json").read_text())
    if MEAN_KEY not in config or STD_KEY not in config:
        return None
    return float(config[MEAN_KEY]), float(config[STD_KEY])


def resolve_reward_model(cfg) -> Path:
    """The directory `reward_model.path` names (a run directory: its latest checkpoint's `reward`), checked."""
    from molt_hpc.models.resolve import run_model

    path = run_model(Path(cfg.path).expanduser(), "reward")
    if not path.exists():
        raise ValueError(f"reward_model.path {path} does not exist; point it at a `molt-hpc rm train` run directory")
    check_model_dir(path)
    if not is_reward_model(path):
        raise ValueError(
            f"reward_model.path {path} is not a reward model (its config.json names no …ForSequenceClassification "
            "architecture); train one with `molt-hpc rm train`"
        )
    return path


def check_reward_model(cfg, policy_tokenizer) -> tuple[float, float]:
    """The (mean, std) scores are normalised with, after checking the reward model can score the
    policy's rollouts (the same vocabulary: it reads their token ids) and has its statistics."""
    from molt_hpc.models.load import load_tokenizer

    path = resolve_reward_model(cfg)
    if load_tokenizer(path).get_vocab() != policy_tokenizer.get_vocab():
        raise ValueError(
            f"the reward model in {path} has another tokenizer than the policy; it scores the rollouts' token "
            "ids, so train it from the policy's model (model.path of `molt-hpc rm train`)"
        )
    if cfg.normalize == "none":
        return 0.0, 1.0
    stats = reward_stats(path)
    if stats is None:
        raise ValueError(
            f"{path} has no held-out score statistics ({MEAN_KEY}, {STD_KEY} in config.json): train it with "
            "`molt-hpc rm train` and an [rm] eval_data file, or set reward_model.normalize = 'none'"
        )
    return stats
