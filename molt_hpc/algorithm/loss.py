"""Steps 6-7 of the RL loop: the policy loss and the value loss, as pure tensor functions.

All per-token tensors are `[B, T]` with the own-index alignment of `experience.py`; only tokens with
`action_mask` True contribute, whatever the other positions hold (their gradient is exactly 0).

**Aggregation over the global batch.** Every loss is `sum over action tokens of c_t · loss_t`, with a
coefficient `c_t` from `AlgorithmConfig.aggregation` and the counts of the *whole optimizer step*,
all micro-batches of all data-parallel ranks (`LossScale`, from `global_loss_scale`): `token-mean`
`1 / tokens`; `seq-mean-token-sum` `1 / samples`; `seq-mean-token-mean` `1 / (samples · |sample|)`;
`seq-mean-token-sum-norm` `1 / (samples · length)` (Dr.GRPO). A sample is one trajectory (a segment
of a packed row, never the row). Gradients must then be *summed* over ranks and micro-batches:
accumulate micro-batches with plain `backward()`, and have the data-parallel reduction sum rather
than average (FSDP2: `model.set_gradient_divide_factor(1.0)`; or scale the loss by the world size).
Adding ranks or micro-batches then leaves the gradient unchanged, whatever the tokens per rank.

**Policy loss.** The ratio is `r = exp(logp - logp_old)` (`log r` clamped to ±20), where the old
policy is the trainer's recomputed one (`old_log_probs`) or else the engine's (`rollout_log_probs`).
Variants, keyed by `AlgorithmConfig.policy_loss` in `POLICY_LOSSES`:

- `ppo` (Schulman et al. 2017; clip-higher of DAPO, dual-clip of Ye et al. 2020):
  `-min(r·A, clip(r, 1-eps_low, 1+eps_high)·A)`; with `dual_clip = c`, for A < 0 the loss is at most `c·|A|`;
- `gspo` (Zheng et al. 2025): the same clip on the sequence ratio `s = exp(mean of log r over the
  sample's action tokens)`, taken per token as `sg(s)·r/sg(r)` (GSPO-token: the value is `s`, the
  gradient `s·∇logp`); GSPO wants small clip ranges (eps around 3e-4);
- `cispo` (MiniMax-M1, 2025): `-sg(clip(r, 1-cispo_eps_low, 1+eps_high))·A·log r` (no lower clip
  unless `cispo_eps_low`): every token keeps a gradient, the IS weight is clipped.

**Off-policy correction** (`is_correction`; decoupled PPO, Hilton et al. 2022; truncated IS, Yao et al.
2025) is a separate detached factor, never the loss's own ratio: `w = exp(logp_old - logp_engine)`
per token or per sample (geometric mean, `is_level`), the gap between the trainer's old policy and the
engine that sampled. `truncate` multiplies the token's loss by `min(w, C)`; `mask` removes tokens (or
whole samples) with `w > C` from the batch: out of the numerator and of every count of `LossScale`
(`policy_mask`). Without `old_log_probs` the old policy *is* the engine, `w = 1` and the factor is
exactly 1 (the config refuses `is_correction` with `old_log_probs = "engine"`). Then `+ kl_coef ·
KL(p || p_ref)` (unless the KL is in the reward) and `- entropy_coef · entropy`, aggregated alike.
"""

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from molt_hpc.algorithm.kl import kl_estimate
from molt_hpc.algorithm.segments import broadcast_to_tokens, count_per_sample, row_seq_index, sum_per_sample
from molt_hpc.config.train import AlgorithmConfig, LossAggKind, PolicyLossKind

LOG_RATIO_CLAMP = 20.0


@dataclass(frozen=True)
class LossScale:
    """The global counts an aggregation divides by, over one optimizer step (all micro-batches, all ranks)."""

    tokens: float
    """Action tokens that train (after `policy_mask`)."""
    samples: int = 0
    """Samples with at least one such token."""
    length: int = 0
    """The constant length of `seq-mean-token-sum-norm` (Dr.GRPO's generation budget)."""


def global_loss_scale(
    masks: Iterable[Tensor], seq_indices: Iterable[Tensor], length: int = 0, group: dist.ProcessGroup | None = None
) -> LossScale:
    """Tokens and samples of `masks` (this rank's micro-batches, with their `seq_index`) summed over
    the ranks of `group` (one all_reduce; every rank must call it). Exact because a sample lives whole
    in one micro-batch of one rank, padded or packed."""
    masks, seq_indices = list(masks), list(seq_indices)
    device = masks[0].device if masks else torch.device("cpu")
    total = torch.zeros(2, dtype=torch.int64, device=device)
    for m, seq in zip(masks, seq_indices, strict=True):
        total[0] += m.sum()
        total[1] += torch.unique(seq[m]).numel()
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    tokens, samples = total.tolist()
    return LossScale(tokens, samples, length)


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


def aggregation_weights(mask: Tensor, seq_index: Tensor, n: int, agg: LossAggKind, scale: LossScale) -> Tensor:
    """`c_t [B, T]` of the module docstring (0 off `mask`): the loss is `sum(c_t · loss_t)`."""
    if agg == "token-mean":
        denom = torch.full(mask.shape, float(scale.tokens), dtype=torch.float64, device=mask.device)
    elif agg == "seq-mean-token-sum":
        denom = torch.full(mask.shape, float(scale.samples), dtype=torch.float64, device=mask.device)
    elif agg == "seq-mean-token-mean":
        length = count_per_sample(seq_index, mask, n).to(torch.float64)
        denom = scale.samples * broadcast_to_tokens(length, seq_index, mask)
    else:
        denom = torch.full(mask.shape, float(scale.samples * scale.length), dtype=torch.float64, device=mask.device)
    if agg != "token-mean" and (scale.samples <= 0 or (agg == "seq-mean-token-sum-norm" and scale.length <= 0)):
        raise ValueError(f"loss_agg {agg!r} needs a LossScale with samples (and length) from global_loss_scale")
    return torch.where(mask, 1.0 / denom.clamp(min=1e-30), torch.zeros((), dtype=torch.float64, device=mask.device))


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
    lo = 0.0 if cfg.cispo_eps_low is None else 1.0 - cfg.cispo_eps_low
    return -(ratio.clamp(lo, hi) * adv * log_ratio), (ratio > hi) | (ratio < lo)


PolicyLossFn = Callable[[Tensor, Tensor, Tensor, Tensor, int, AlgorithmConfig], PolicyTerms]
POLICY_LOSSES: dict[PolicyLossKind, PolicyLossFn] = {"ppo": ppo_loss, "gspo": gspo_loss, "cispo": cispo_loss}


def is_log_weights(
    old_log_probs: Tensor | None, rollout_log_probs: Tensor, mask: Tensor, seq_index: Tensor, n: int, level: str
) -> Tensor:
    """`log w [B, T]`, detached: the trainer's old policy over the engine, per token or per sample
    (mean over its action tokens); 0 without old log-probs."""
    if old_log_probs is None:
        return torch.zeros(mask.shape, dtype=rollout_log_probs.dtype, device=mask.device)
    old = old_log_probs.detach().to(rollout_log_probs.dtype)
    log_w = _masked(old - rollout_log_probs, mask)
    log_w = log_w.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if level == "sequence":
        seq_log = sum_per_sample(log_w, seq_index, mask, n) / count_per_sample(seq_index, mask, n).clamp(min=1)
        log_w = broadcast_to_tokens(seq_log, seq_index, mask)
    return log_w


def policy_mask(
    action_mask: Tensor,
    rollout_log_probs: Tensor,
    cfg: AlgorithmConfig,
    *,
    old_log_probs: Tensor | None = None,
    seq_index: Tensor | None = None,
    n_samples: int | None = None,
) -> Tensor:
    """The action tokens that train: all of them, but with `is_correction = "mask"` those (or the
    samples) whose `w` exceeds `is_threshold`. `global_loss_scale` counts this mask."""
    if cfg.is_correction != "mask" or old_log_probs is None:
        return action_mask
    seq_index = row_seq_index(action_mask) if seq_index is None else seq_index
    n = n_samples if n_samples is not None else int(seq_index.max().item()) + 1
    log_w = is_log_weights(old_log_probs, rollout_log_probs, action_mask, seq_index, n, cfg.is_level)
    return action_mask & (torch.exp(log_w) <= cfg.is_threshold)


def _is_factor(log_w: Tensor, mask: Tensor, cfg: AlgorithmConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """The detached factor of `is_correction = "truncate"` (1 otherwise), and the metrics of `w`."""
    w = torch.exp(log_w)
    factor = w.clamp(max=cfg.is_threshold) if cfg.is_correction == "truncate" else torch.ones_like(w)
    metrics = {
        "is_weight_mean": _masked_mean(w, mask),
        "is_weight_max": _masked(w, mask).max(),  # 0 without a token: w > 0 elsewhere
        "is_over_threshold_frac": _masked_mean((w > cfg.is_threshold).to(w.dtype), mask),
    }
    return factor, metrics


def _ratio_metrics(log_ratio: Tensor, engine_log_ratio: Tensor, clipped: Tensor, mask: Tensor) -> dict[str, Tensor]:
    ratio = torch.exp(log_ratio.detach())
    return {
        "clip_frac": _masked_mean(clipped.to(ratio.dtype), mask),
        "ratio_mean": _masked_mean(ratio, mask),
        "ratio_max": _masked_extreme(ratio, mask, torch.amax),
        "ratio_min": _masked_extreme(ratio, mask, torch.amin),
        # k3 estimate of KL(current policy || rollout policy): how far training has moved from the sampler.
        "kl_rollout": _masked_mean(torch.expm1(-engine_log_ratio) + engine_log_ratio, mask),
    }


def policy_loss(
    log_probs: Tensor,
    rollout_log_probs: Tensor,
    advantages: Tensor,
    action_mask: Tensor,
    cfg: AlgorithmConfig,
    scale: LossScale | float,
    *,
    seq_index: Tensor | None = None,
    n_samples: int | None = None,
    base_log_probs: Tensor | None = None,
    entropy: Tensor | None = None,
    old_log_probs: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The policy loss of one micro-batch (its share of the step's aggregate) and its metrics.

    `log_probs [B, T]` is the trainer's (with gradient, from `logprobs.token_logprobs`);
    `rollout_log_probs` (the engine's), `advantages`, `base_log_probs` (needed when the KL is in the
    loss) and `old_log_probs` (the recomputed old policy; unset: the engine is the old policy) are
    `[B, T]`; `entropy [B, T]` is optional (the bonus is skipped without it). `scale` is the step's
    `LossScale` (a number: the token count, `token-mean` only). `seq_index` defaults to one sample
    per row; `n_samples` to `seq_index.max() + 1`. Metrics are detached 0-dim tensors, means over this
    micro-batch's training tokens.
    """
    scale = scale if isinstance(scale, LossScale) else LossScale(scale)
    if scale.tokens <= 0:
        raise ValueError(f"token_count (LossScale.tokens) must be the positive global token count, got {scale.tokens}")
    seq_index = row_seq_index(action_mask) if seq_index is None else seq_index
    n = n_samples if n_samples is not None else int(seq_index.max().item()) + 1
    rollout = rollout_log_probs.to(log_probs.dtype)
    mask = policy_mask(action_mask, rollout, cfg, old_log_probs=old_log_probs, seq_index=seq_index, n_samples=n)
    old = rollout if old_log_probs is None else old_log_probs.to(log_probs.dtype)
    log_ratio = _masked((log_probs - old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP), mask)
    adv = _masked(advantages.to(log_probs.dtype), mask)

    tok_loss, clipped = POLICY_LOSSES[cfg.policy_loss](log_ratio, adv, mask, seq_index, n, cfg)
    log_w = is_log_weights(old_log_probs, rollout, action_mask, seq_index, n, cfg.is_level)
    factor, metrics = _is_factor(log_w.to(log_probs.dtype), action_mask, cfg)
    tok_loss = tok_loss * factor
    coef = aggregation_weights(mask, seq_index, n, cfg.aggregation, scale).to(log_probs.dtype)
    engine_log_ratio = _masked((log_probs.detach() - rollout).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP), mask)
    metrics |= _ratio_metrics(log_ratio, engine_log_ratio, clipped, mask)
    metrics["policy_loss"] = _masked(tok_loss * coef, mask).sum().detach()
    tok_loss = tok_loss + _kl_and_entropy(log_probs, base_log_probs, entropy, mask, cfg, metrics)
    loss = _masked(tok_loss * coef, mask).sum()
    return loss, {k: v.detach() for k, v in metrics.items()}


def _kl_and_entropy(
    log_probs: Tensor, base: Tensor | None, entropy: Tensor | None, mask: Tensor, cfg: AlgorithmConfig, metrics: dict
) -> Tensor:
    """The per-token `kl_coef · KL - entropy_coef · entropy` (0 where off); fills their metrics."""
    out = torch.zeros_like(log_probs)
    if cfg.kl_coef > 0 and not cfg.kl_in_reward:
        if base is None:
            raise ValueError("algorithm.kl_coef > 0 puts the KL in the loss: pass base_log_probs (reference)")
        kl = kl_estimate(_masked(log_probs, mask), _masked(base.to(log_probs.dtype), mask), cfg.kl_estimator)
        out = out + cfg.kl_coef * kl
        metrics["kl"] = _masked_mean(kl.detach(), mask)
    if entropy is not None:
        ent = _masked(entropy.to(log_probs.dtype), mask)
        if cfg.entropy_coef > 0:
            out = out - cfg.entropy_coef * ent
        metrics["entropy"] = _masked_mean(ent.detach(), mask)
    return out


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
