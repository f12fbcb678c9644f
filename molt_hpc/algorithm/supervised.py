"""The losses of the stages beyond RL, as pure tensor functions: SFT's token mean and Bradley-Terry.

**SFT.** `sft_loss = -Σ log p(token) over the supervised tokens / token_count`, where `token_count`
is the supervised-token count of the whole optimizer step over every data-parallel rank: the same
global token mean as the RL loss (`loss.py`), so adding ranks or micro-batches leaves the gradient
unchanged. Log-probs are at the token's own index (`experience.py`'s convention).

**Bradley-Terry.** Per pair, `-log σ(r_chosen - r_rejected - margin)`, plus, with reward centering,
`center_coef · (r_chosen + r_rejected)²` (TRL's `center_rewards_coefficient`; arXiv 2312.09244
eq. 2), which pins the scale's free offset near 0. A step's loss is the sum over its pairs divided
by the step's pair count (every rank holds the whole step, so that count needs no collective).
"""

import torch
import torch.nn.functional as F
from torch import Tensor


def sft_loss(logp: Tensor, mask: Tensor, token_count: int) -> Tensor:
    """`[B, T]` own-index log-probs and supervised-token mask → this micro-batch's share of the step's
    global token mean of the negative log-likelihood (gradient 0 wherever `mask` is False)."""
    picked = torch.where(mask, logp, torch.zeros((), dtype=logp.dtype, device=logp.device))
    return -picked.sum() / max(token_count, 1)


def bradley_terry(chosen: Tensor, rejected: Tensor, margin: Tensor | None = None, center_coef: float = 0.0) -> Tensor:
    """`[P]` per-pair loss from the scores of the chosen and rejected sides (and optional margins)."""
    diff = chosen - rejected
    if margin is not None:
        diff = diff - margin
    loss = -F.logsigmoid(diff)
    if center_coef:
        loss = loss + center_coef * (chosen + rejected) ** 2
    return loss


def pair_accuracy(chosen: Tensor, rejected: Tensor) -> Tensor:
    """Fraction of pairs whose chosen side scores strictly higher (a tie counts as wrong)."""
    return (chosen > rejected).float().mean()
