"""One molt-hpc config mapped onto TRL's `GRPOConfig`, and onto the molt-hpc command line, for the peer benchmark.

TRL keeps every default except the settings that must equal the molt-hpc run's (each one commented in
`grpo_changes`); what cannot be matched exactly is returned as a note, printed beside the results. No import of
TRL here: the mapping is a dict of keyword arguments, so the driver prints it without building anything.
"""

import dataclasses
import math
from typing import Any

from molt_hpc.config import MoltConfig

LONG_RUN = 1_000_000
"""Steps of a run that the budget ends (a constant learning rate does not depend on the step count)."""

SCHEDULES = {"constant": "constant", "linear": "linear", "cosine": "cosine_with_min_lr"}
LOSS_TYPES = {
    # molt-hpc's aggregation over the whole optimizer step -> TRL's loss_type with the same normaliser
    "token-mean": "dapo",  # sum / action tokens of the global accumulated batch
    "seq-mean-token-mean": "grpo",  # each sample's token mean, averaged over samples
    "seq-mean-token-sum-norm": "dr_grpo",  # sum / (samples x max_completion_length)
    "seq-mean-token-sum": "dr_grpo",  # sum / samples: dr_grpo up to the constant max_completion_length (noted)
}


def train_steps(cfg: MoltConfig) -> int:
    """Steps both sides are configured for: many under a constant learning rate (the budget stops the run),
    else the config's `run.steps`, which the decaying schedule spans."""
    return LONG_RUN if cfg.actor.lr_schedule == "constant" else cfg.run.steps


def batch_split(cfg: MoltConfig) -> tuple[int, int]:
    """(per-device batch, gradient accumulation): molt-hpc's micro-batch of sequences per forward, accumulated
    up to one optimizer step of `groups_per_step x n_samples` sequences (TRL's generation batch is then the whole
    step's, one generation per optimizer step, as molt-hpc's step)."""
    act = cfg.actor
    batch = act.groups_per_step * cfg.rollout.n_samples
    per_device = max(d for d in range(1, min(act.micro_batch_size, batch) + 1) if batch % d == 0)
    return per_device, batch // per_device


def schedule(cfg: MoltConfig) -> str:
    """The transformers scheduler of molt-hpc's `actor.lr_schedule` (a constant one warms up when asked)."""
    if cfg.actor.lr_schedule == "constant" and cfg.actor.warmup_steps:
        return "constant_with_warmup"
    return SCHEDULES[cfg.actor.lr_schedule]


def grpo_changes(cfg: MoltConfig, *, output_dir: str, seed: int, use_vllm: bool) -> dict[str, Any]:
    """The `GRPOConfig` keyword arguments that differ from TRL's defaults (or are set to an equal value because
    they must match). Raises `ValueError` for a molt-hpc algorithm TRL's GRPO trainer does not have."""
    alg, act, ro = cfg.algorithm, cfg.actor, cfg.rollout
    if alg.advantage not in ("grpo", "dr_grpo"):
        raise ValueError(f"algorithm.advantage = {alg.advantage!r}: TRL's GRPOTrainer has grpo and dr_grpo only")
    if act.ppo_epochs != 1 or act.mini_batches != 1:
        raise ValueError("the bench maps actor.ppo_epochs = 1 and actor.mini_batches = 1 (one update per batch)")
    per_device, accumulation = batch_split(cfg)
    out: dict[str, Any] = {
        "output_dir": output_dir,  # each run's own folder
        "seed": seed,  # the run's seed (run.seed on the molt-hpc side)
        "max_steps": train_steps(cfg),  # molt-hpc's run.steps (the budget ends either run first)
        "learning_rate": act.lr,
        "lr_scheduler_type": schedule(cfg),
        "warmup_steps": act.warmup_steps,
        "adam_beta1": act.betas[0],
        "adam_beta2": act.betas[1],
        "weight_decay": act.weight_decay,
        "max_grad_norm": act.grad_clip,
        "per_device_train_batch_size": per_device,  # molt-hpc's sequences per forward/backward
        "gradient_accumulation_steps": accumulation,  # ... accumulated to groups_per_step x n_samples
        "num_generations": ro.n_samples,  # the group size
        "max_completion_length": ro.max_new_tokens,
        "temperature": ro.temperature,
        "top_p": ro.top_p,
        "top_k": ro.top_k,  # 0 disables top-k on both sides
        "beta": alg.kl_coef,  # KL weight (k3 in the loss on both sides)
        "epsilon": alg.eps_low,
        "epsilon_high": 1.0 + alg.eps_high if alg.policy_loss == "cispo" else alg.eps_high,  # cispo: the IS cap
        "loss_type": "cispo" if alg.policy_loss == "cispo" else LOSS_TYPES[alg.aggregation],
        "importance_sampling_level": "sequence" if alg.policy_loss == "gspo" else "token",
        "scale_rewards": "group" if alg.advantage == "grpo" else "none",  # dr_grpo: no std
        "entropy_coef": alg.entropy_coef,
        "bf16": cfg.model.dtype == "bfloat16",  # TRL's default is bf16; an fp32 config computes in fp32
        "fp16": cfg.model.dtype == "float16",
        # TRL's default recomputes activations; both sides make the same trade
        checkpointing_field(): act.activation_checkpointing,
        "use_vllm": use_vllm,  # trl-vllm: TRL's default vLLM mode (colocate) on the trainer's GPU
    }
    if act.lr_schedule != "constant":
        out["lr_scheduler_kwargs"] = {"min_lr_rate": act.min_lr_ratio} if act.lr_schedule == "cosine" else {}
    if cfg.model.attn_implementation != "sdpa":
        out["model_init_kwargs"] = {"attn_implementation": cfg.model.attn_implementation}
    return out


def checkpointing_field() -> str:
    """The name of the activation-recompute flag in the installed TrainingArguments: transformers renamed
    `gradient_checkpointing` to `activation_checkpointing` (5.17 has the old name, 5.24 the new)."""
    try:
        from trl import GRPOConfig
    except ImportError:  # the settings are only printed where TRL is missing
        return "activation_checkpointing"
    names = {field.name for field in dataclasses.fields(GRPOConfig)}
    return "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"


def differences(cfg: MoltConfig, system: str) -> list[str]:
    """What the mapping cannot make equal, one line each (the notes under the results table)."""
    alg, act, ro, ev = cfg.algorithm, cfg.actor, cfg.rollout, cfg.eval
    notes = [
        "data order: molt-hpc draws length-balanced buckets shuffled from run.seed; TRL shuffles uniformly (seed)",
        f"advantage: molt-hpc divides by std + {alg.adv_eps:g} (algorithm.adv_eps), TRL by std + 1e-4",
        "off-policy: molt-hpc trains groups up to buffer.max_staleness = "
        f"{cfg.buffer.max_staleness} versions old (ratio against the engine's log-probs); TRL generates with the "
        "current weights every step"
        + (" (its vLLM IS correction, sequence_mask at 3.0, is on)" * (system == "trl-vllm")),
        "micro-batches: molt-hpc packs samples into rows (actor.packing); TRL pads one row per sample"
        if act.packing != "off"
        else "",
        f"evaluation: molt-hpc evaluates every eval.every = {ev.every if ev else '-'} versions beside training "
        "(no evaluation at the stop); TRL every --trl-eval-every-s training seconds with its clock paused",
        "stop: molt-hpc gets SIGTERM at the budget (it checkpoints at the next step boundary); TRL stops before a step "
        "that would end past the budget; steps and evaluations after the budget are not counted",
        f"checkpoints: molt-hpc every checkpoint.interval = {cfg.checkpoint.interval} steps, TRL every save_steps = "
        "500 (its default)",
    ]
    if alg.dynamic_sampling:
        notes.append(
            "dynamic sampling: molt-hpc drops equal-reward groups (algorithm.dynamic_sampling); TRL trains them with "
            "zero advantage and counts their tokens in the loss normaliser"
        )
    if alg.aggregation == "seq-mean-token-sum":
        notes.append(f"loss: TRL dr_grpo also divides by max_completion_length = {ro.max_new_tokens} (a constant)")
    if alg.aggregation == "seq-mean-token-sum-norm" and alg.loss_agg_length not in (None, ro.max_new_tokens):
        notes.append(f"loss: molt-hpc's constant is {alg.loss_agg_length}, TRL's max_completion_length")
    if alg.policy_loss == "cispo" and (alg.aggregation != "token-mean" or alg.cispo_eps_low is not None):
        notes.append("loss: TRL's cispo is token-mean with no lower clip")
    notes += _optional_differences(cfg)
    return [n for n in notes if n]


def _optional_differences(cfg: MoltConfig) -> list[str]:
    alg, act, ro = cfg.algorithm, cfg.actor, cfg.rollout
    notes = []
    if act.warmup_steps:
        notes.append(f"warm-up: molt-hpc's step s takes (s+1)/{act.warmup_steps} of the lr, TRL's s/{act.warmup_steps}")
    if act.lr_schedule == "linear" and act.min_lr_ratio > 0:
        notes.append(f"lr: TRL's linear decay ends at 0, molt-hpc's at min_lr_ratio = {act.min_lr_ratio}")
    if alg.kl_coef > 0 and (alg.kl_estimator != "k3" or alg.kl_in_reward):
        notes.append(f"KL: TRL puts k3 in the loss; molt-hpc {alg.kl_estimator} (in reward: {alg.kl_in_reward})")
    if alg.kl_coef > 0:
        notes.append("KL: TRL weights its k3 term by the importance ratio (use_bias_correction_kl)")
    for name, on in (
        ("dual_clip", alg.dual_clip is not None),
        ("is_correction", alg.is_correction != "none"),
        ("overlong_buffer", alg.overlong_buffer > 0),
        ("whiten_advantages", alg.whiten),
        ("kl_target", alg.kl_target is not None),
    ):
        if on:
            notes.append(f"algorithm.{name}: no TRL GRPOConfig equivalent, TRL runs without it")
    if cfg.data.max_prompt_tokens + ro.max_new_tokens > ro.max_total_tokens:
        notes.append("length: molt-hpc caps a long prompt's completion at rollout.max_total_tokens, TRL does not")
    if math.prod(batch_split(cfg)) != act.groups_per_step * ro.n_samples or batch_split(cfg)[0] != act.micro_batch_size:
        notes.append(f"micro-batch: TRL's per-device batch is {batch_split(cfg)[0]} (divides the step's batch)")
    if act.ranks > 1:
        notes.append(f"processes: molt-hpc trains on actor.ranks = {act.ranks}, TRL in one process")
    if act.lr_schedule != "constant":
        notes.append(f"steps: both are set to run.steps = {cfg.run.steps}; a run that finishes them ends early")
    return notes


def molt_command(
    config: str, overrides: list[str], *, system: str, root: str, name: str, seed: int, cfg: MoltConfig, model: str
):
    """(the `molt-hpc run` arguments, the overrides the bench adds to the user's). `model` is the directory the
    driver built before any clock started, which TRL loads too: neither side pays for a conversion."""
    added = [
        f"model.path={model}",
        f"run.root={root}",
        f"run.name={name}",
        f"run.seed={seed}",
        f"run.steps={train_steps(cfg)}",
        "logging.progress=lines",
        f"engines.kind={'vllm' if system == 'molt-vllm' else 'builtin'}",
    ]
    args = ["run", config]
    for item in [*overrides, *added]:
        args += ["--set", item]
    return args, added
