"""KL to the reference model from per-token log-probs, and the adaptive KL coefficient.

Samples come from the policy p; with `log r = log p_ref - log p` per token (Schulman, 2020):
`k1 = -log r` (unbiased, can be negative), `k2 = (log r)^2 / 2`, `k3 = r - 1 - log r` (unbiased,
never negative); `abs = |log r|` and `mse = (log r)^2 / 2` are the names other frameworks use (`mse`
is k2). Used in the loss (gradients flow through `log_probs`) or, detached, as a per-token penalty in
the reward (`advantage.token_rewards`).

`adaptive_kl_coef` is the proportional controller of Ziegler et al. (2019), "Fine-Tuning Language
Models from Human Preferences": `β ← β · (1 + clip(KL / KL_target - 1, -0.2, 0.2) · n / horizon)`.
"""

from collections.abc import Callable

import torch
from torch import Tensor

KLEstimator = Callable[[Tensor], Tensor]

KL_ESTIMATORS: dict[str, KLEstimator] = {
    "k1": lambda log_r: -log_r,
    "k2": lambda log_r: 0.5 * log_r**2,
    "k3": lambda log_r: torch.expm1(log_r) - log_r,
    "abs": lambda log_r: log_r.abs(),
    "mse": lambda log_r: 0.5 * log_r**2,
}


def kl_estimate(log_probs: Tensor, ref_log_probs: Tensor, estimator: str = "k3", clamp: float = 20.0) -> Tensor:
    """Per-token KL(p || p_ref) estimate, same shape as the inputs.

    `log r` is clamped to ±`clamp` so one token whose reference log-prob is extreme cannot turn k3
    into inf; callers mask non-action tokens themselves.
    """
    log_r = (ref_log_probs - log_probs).clamp(-clamp, clamp)
    return KL_ESTIMATORS[estimator](log_r)


def adaptive_kl_coef(coef: float, observed_kl: float, target: float, horizon: int, n_samples: int) -> float:
    """The KL coefficient after one step that measured `observed_kl` on `n_samples` samples."""
    error = min(max(observed_kl / target - 1.0, -0.2), 0.2)
    return coef * (1.0 + error * n_samples / horizon)
