"""Steps 6-7 of the RL loop: the policy loss and the value loss, as pure tensor functions.

All per-token tensors are `[B, T]` with the own-index alignment of `experience.py`; only tokens with
`action_mask` True contribute, whatever the other positions hold (their gradient is exactly 0).

**Global token mean.** Every loss is `sum over action tokens / token_count`, where `token_count` is
the action-token count of the *whole optimizer step*: all micro-batches of all data-parallel ranks
(`global_token_count`). Gradients must then be *summed* over ranks and micro-batches: accumulate
micro-batches with plain `backward()`, and have the data-parallel reduction sum rather than average
(FSDP2: `model.set_gradient_divide_factor(1.0)`; or scale the loss by the world size). Adding ranks
or micro-batches then leaves the gradient unchanged, whatever the token count per rank.

**Policy loss.** The ratio is `r = exp(logp - logp_rollout)` against the engine's log-probs
(`log r` clamped to ±20). Variants, keyed by `AlgorithmConfig.policy_loss` in `POLICY_LOSSES`:

- `ppo`: `-min(r·A, clip(r, 1-eps_low, 1+eps_high)·A)`; with `dual_clip = c`, for A < 0 the loss is
  at most `c·|A|`;
- `gspo`: the same clip on the sequence ratio `s = exp(mean of log r over the sample's action
  tokens)`, taken per token as `sg(s)·r/sg(r)` (GSPO-token: the value is `s`, the gradient `s·∇logp`);
  GSPO wants small clip ranges (eps around 3e-4);
- `cispo`: `-sg(min(r, 1+eps_high))·A·log r`: every token keeps a gradient, the IS weight is clipped.

On top, `is_correction` multiplies each token's policy term by a detached factor from the weight
`w = r` (`is_level = "token"`) or the sample's geometric-mean ratio (`"sequence"`): `truncate` gives
`min(1, C/w)` (the gradient weight becomes `min(w, C)`), `mask` gives `1[w <= C]`, with
`C = is_threshold`. Then `+ kl_coef · KL(p || p_ref)` (unless the KL is in the reward) and
`- entropy_coef · entropy`.
"""

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import Tensor

from molt_hpc.algorithm.kl import kl_estimate
from molt_hpc.algorithm.segments import broadcast_to_tokens, count_per_sample, row_seq_index, sum_per_sample
from molt_hpc.config.train import AlgorithmConfig, PolicyLossKind

LOG_RATIO_CLAMP = 20.0


def global_token_count(action_masks: Tensor | Iterable[Tensor], group: dist.ProcessGroup | None = None) -> int:
    """Action tokens of one optimizer step: summed over the given masks (this rank's micro-batches) and,
    when a process group is active, over all ranks of `group` (an all_reduce). Every rank must call
    it; the masks must live on the device the group's backend reduces on (CUDA for NCCL)."""
    masks = [action_masks] if isinstance(action_masks, Tensor) else list(action_masks)
    device = masks[0].device if masks else torch.device("cpu")
    total = torch.zeros((), dtype=torch.int64, device=device)
    for m in masks:
        total += m.sum()
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return int(total.item())


def _masked(x: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))


def _masked_extreme(x: Tensor, mask: Tensor, op) -> Tensor:
    """`op` (amax / amin) of `x` over `mask`, 1 without a token; no host sync (boolean indexing and
    `mask.any()` in Python would each wait for the device)."""
    fill = torch.tensor(float("-inf") if op is torch.amax else float("inf"), dtype=x.dtype, device=x.device)
    out = op(torch.where(mask, x, fill))
    return torch.where(mask.any(), out, torch.ones((), dtype=x.dtype, device=x.device))


def _masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    return _masked(x, mask).sum() / mask.sum().clamp(min=1)


def _clip_objective(log_ratio: Tensor, adv: Tensor, cfg: AlgorithmConfig) -> tuple[Tensor, Tensor]:
    """PPO-clip (+ dual-clip) per-token loss on a ratio given by its log, and where a clip is active."""
    ratio = torch.exp(log_ratio)
    lo, hi = 1.0 - cfg.eps_low, 1.0 + cfg.eps_high
    objective = torch.minimum(ratio * adv, ratio.clamp(lo, hi) * adv)
    clipped = ((adv > 0) & (ratio > hi)) | ((adv < 0) & (ratio < lo))
    if cfg.dual_clip is not None:
        floor = cfg.dual_clip * adv
        dual = (adv < 0) & (objective < floor)
        objective = torch.where(dual, floor, objective)
        clipped = clipped | dual
    return -objective, clipped


PolicyTerms = tuple[Tensor, Tensor]
"""(per-token loss [B, T], bool [B, T] where a clip removed the gradient or bounded the weight)."""


def ppo_loss(log_ratio: Tensor, adv: Tensor, mask: Tensor, seq_index: Tensor, n: int, cfg: AlgorithmConfig):
    """PPO-clip on the token ratio (with clip-higher and optional dual-clip)."""
    return _clip_objective(log_ratio, adv, cfg)


def gspo_loss(log_ratio: Tensor, adv: Tensor, mask: Tensor, seq_index: Tensor, n: int, cfg: AlgorithmConfig):
    """GSPO: PPO-clip on the sequence-level ratio (geometric mean over the sample's action tokens)."""
    seq_log = sum_per_sample(log_ratio, seq_index, mask, n) / count_per_sample(seq_index, mask, n).clamp(min=1)
    token_seq_log = broadcast_to_tokens(seq_log.detach(), seq_index, mask) + log_ratio - log_ratio.detach()
    return _clip_objective(token_seq_log, adv, cfg)


def cispo_loss(log_ratio: Tensor, adv: Tensor, mask: Tensor, seq_index: Tensor, n: int, cfg: AlgorithmConfig):
    """CISPO: clipped, stop-gradient IS weight times the log-prob (`log r` has the gradient of `log p`)."""
    ratio = torch.exp(log_ratio.detach())
    hi = 1.0 + cfg.eps_high
    return -(ratio.clamp(max=hi) * adv * log_ratio), ratio > hi


PolicyLossFn = Callable[[Tensor, Tensor, Tensor, Tensor, int, AlgorithmConfig], PolicyTerms]
POLICY_LOSSES: dict[PolicyLossKind, PolicyLossFn] = {"ppo": ppo_loss, "gspo": gspo_loss, "cispo": cispo_loss}


def is_weights(
    log_ratio: Tensor, mask: Tensor, seq_index: Tensor, n: int, cfg: AlgorithmConfig
) -> tuple[Tensor, dict[str, Tensor]]:
    """The detached per-token factor of `is_correction`, and its metrics (weight stats, fraction corrected)."""
    log_ratio = log_ratio.detach()
    if cfg.is_level == "sequence":
        seq_log = sum_per_sample(log_ratio, seq_index, mask, n) / count_per_sample(seq_index, mask, n).clamp(min=1)
        log_ratio = broadcast_to_tokens(seq_log, seq_index, mask)
    w = torch.exp(log_ratio)
    over = mask & (w > cfg.is_threshold)
    if cfg.is_correction == "truncate":
        factor = (cfg.is_threshold / w).clamp(max=1.0)
    elif cfg.is_correction == "mask":
        factor = (~over).to(w.dtype)
    else:
        factor = torch.ones_like(w)
    metrics = {
        "is_weight_mean": _masked_mean(w, mask),
        "is_weight_max": _masked(w, mask).max(),  # 0 without a token: w > 0 elsewhere
        "is_over_threshold_frac": _masked_mean(over.to(w.dtype), mask),
    }
    return factor, metrics


def policy_loss(
    log_probs: Tensor,
    rollout_log_probs: Tensor,
    advantages: Tensor,
    action_mask: Tensor,
    cfg: AlgorithmConfig,
    token_count: float,
    *,
    seq_index: Tensor | None = None,
    n_samples: int | None = None,
    base_log_probs: Tensor | None = None,
    entropy: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The policy loss of one micro-batch (sum over its action tokens / `token_count`) and its metrics.

    `log_probs [B, T]` is the trainer's (with gradient, from `logprobs.token_logprobs`);
    `rollout_log_probs`, `advantages` and `base_log_probs` (needed when the KL is in the loss) are
    `[B, T]`; `entropy [B, T]` is optional (the bonus is skipped without it). `seq_index` defaults to
    one sample per row; `n_samples` to `seq_index.max() + 1`. Metrics are detached 0-dim tensors,
    means over this micro-batch's action tokens.
    """
    if token_count <= 0:
        raise ValueError(f"token_count must be the positive global action-token count, got {token_count}")
    mask = action_mask
    if seq_index is None:
        seq_index = row_seq_index(mask)
    n = n_samples if n_samples is not None else int(seq_index.max().item()) + 1
    # Chat-mode samples carry no engine log-probs (NaN): they are on-policy by definition, so ratio 1.
    rollout_log_probs = torch.where(rollout_log_probs.isnan(), log_probs.detach(), rollout_log_probs)
    log_ratio = _masked((log_probs - rollout_log_probs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP), mask)
    adv = _masked(advantages.to(log_probs.dtype), mask)

    tok_loss, clipped = POLICY_LOSSES[cfg.policy_loss](log_ratio, adv, mask, seq_index, n, cfg)
    factor, metrics = is_weights(log_ratio, mask, seq_index, n, cfg)
    tok_loss = tok_loss * factor
    ratio = torch.exp(log_ratio.detach())
    metrics |= {
        "policy_loss": _masked(tok_loss, mask).sum().detach() / token_count,
        "clip_frac": _masked_mean(clipped.to(ratio.dtype), mask),
        "ratio_mean": _masked_mean(ratio, mask),
        "ratio_max": _masked_extreme(ratio, mask, torch.amax),
        "ratio_min": _masked_extreme(ratio, mask, torch.amin),
        # k3 estimate of KL(current policy || rollout policy): how far training has moved from the sampler.
        "kl_rollout": _masked_mean(torch.expm1(-log_ratio.detach()) + log_ratio.detach(), mask),
    }
    if cfg.kl_coef > 0 and not cfg.kl_in_reward:
        if base_log_probs is None:
            raise ValueError("algorithm.kl_coef > 0 puts the KL in the loss: pass base_log_probs (reference)")
        kl = kl_estimate(_masked(log_probs, mask), _masked(base_log_probs.to(log_probs.dtype), mask), cfg.kl_estimator)
        tok_loss = tok_loss + cfg.kl_coef * kl
        metrics["kl"] = _masked_mean(kl.detach(), mask)
    if entropy is not None:
        ent = _masked(entropy.to(log_probs.dtype), mask)
        if cfg.entropy_coef > 0:
            tok_loss = tok_loss - cfg.entropy_coef * ent
        metrics["entropy"] = _masked_mean(ent.detach(), mask)
    loss = _masked(tok_loss, mask).sum() / token_count
    return loss, {k: v.detach() for k, v in metrics.items()}


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    action_mask: Tensor,
    token_count: float,
    clip: float = 0.2,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value loss `0.5 · max((v - R)^2, (clip(v, v_old ± clip) - R)^2)`, summed over action tokens
    / `token_count` (the same global count as the policy loss). Scale by `value_coef` outside."""
    if token_count <= 0:
        raise ValueError(f"token_count must be the positive global action-token count, got {token_count}")
    mask = action_mask
    v = _masked(values, mask)
    old = _masked(old_values.to(v.dtype), mask)
    ret = _masked(returns.to(v.dtype), mask)
    v_clipped = old + (v - old).clamp(-clip, clip)
    unclipped_sq, clipped_sq = (v - ret) ** 2, (v_clipped - ret) ** 2
    loss = _masked(0.5 * torch.maximum(unclipped_sq, clipped_sq), mask).sum() / token_count
    metrics = {
        "value_clip_frac": _masked_mean((clipped_sq > unclipped_sq).to(v.dtype), mask),
        "value_mean": _masked_mean(v.detach(), mask),
        "return_mean": _masked_mean(ret, mask),
    }
    return loss, {k: x.detach() for k, x in metrics.items()}
