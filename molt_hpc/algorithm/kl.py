"""KL to the reference model from per-token log-probs: the k1/k2/k3 estimators (Schulman, 2020).

Samples come from the policy p; with `log r = log p_ref - log p` per token:
`k1 = -log r` (unbiased, can be negative), `k2 = (log r)^2 / 2`, `k3 = r - 1 - log r` (unbiased,
never negative). Used in the loss (gradients flow through `log_probs`) or, detached, as a per-token
penalty in the reward (`advantage.token_rewards`).
"""

from collections.abc import Callable

import torch
from torch import Tensor

KLEstimator = Callable[[Tensor], Tensor]

KL_ESTIMATORS: dict[str, KLEstimator] = {
    "k1": lambda log_r: -log_r,
    "k2": lambda log_r: 0.5 * log_r**2,
    "k3": lambda log_r: torch.expm1(log_r) - log_r,
}


def kl_estimate(log_probs: Tensor, ref_log_probs: Tensor, estimator: str = "k3", clamp: float = 20.0) -> Tensor:
    """Per-token KL(p || p_ref) estimate, same shape as the inputs.

    `log r` is clamped to ±`clamp` so one token whose reference log-prob is extreme cannot turn k3
    into inf; callers mask non-action tokens themselves.
    """
    log_r = (ref_log_probs - log_probs).clamp(-clamp, clamp)
    return KL_ESTIMATORS[estimator](log_r)
