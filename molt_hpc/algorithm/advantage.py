"""Step 5 of the RL loop: advantages (and returns) from rewards, as pure tensor functions.

Group estimators give one scalar per sample, compared within its group (`group_index [N]`, groups of
any size) and placed on every action token of the sample:

- `grpo_advantages`: (r - group mean) / (group std + eps), std with Bessel's correction;
- `dr_grpo_advantages`: r - group mean (no std; no length normalisation either, which holds because
  the losses divide by a batch-wide token count, never by a sample's own length);
- `rloo_advantages`: r - mean of the *other* samples of the group.

Token estimators run a recursion over each sample's **action tokens only** (prompt and env-feedback
tokens are skipped: the next action token after a feedback span is the "next step"), with the
sample's reward placed on its last action token (`token_rewards`):

- `reinforce_pp_advantages`: discounted returns with a per-token KL penalty in the reward
  (REINFORCE++, Hu 2025); `reinforce_pp_baseline` first subtracts the group-mean reward
  (REINFORCE++-baseline);
- `gae`: generalised advantage estimation with critic values; returns = advantages + values.

`whiten` normalises advantages over all action tokens of the step's batch (masked mean, Bessel std),
as REINFORCE++ does and as every reference PPO implementation does to GAE advantages
(`AlgorithmConfig.whiten`: on for those three, off for the group estimators unless asked).

`compute_advantages(exp, cfg)` picks the estimator from `ADVANTAGES`, keyed by
`AlgorithmConfig.advantage`, whitens when configured, and fills `exp.advantages` / `exp.returns`.
"""

from collections.abc import Callable

import torch
from torch import Tensor

from molt_hpc.algorithm.experience import Experience
from molt_hpc.algorithm.kl import kl_estimate
from molt_hpc.algorithm.segments import (
    broadcast_to_tokens,
    from_sample_major,
    sum_per_sample,
    to_sample_major,
)
from molt_hpc.config.train import AdvantageKind, AlgorithmConfig


def group_stats(reward: Tensor, group_index: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per sample: its group's (mean, std with Bessel's correction, size); std is 0 for a group of 1."""
    g = int(group_index.max().item()) + 1
    r = reward.double()
    size = torch.zeros(g, dtype=torch.float64).index_add(0, group_index, torch.ones_like(r))
    mean = torch.zeros(g, dtype=torch.float64).index_add(0, group_index, r) / size.clamp(min=1)
    sq = torch.zeros(g, dtype=torch.float64).index_add(0, group_index, (r - mean[group_index]) ** 2)
    std = (sq / (size - 1).clamp(min=1)).sqrt()
    cast = reward.dtype
    return mean[group_index].to(cast), std[group_index].to(cast), size[group_index].to(cast)


def grpo_advantages(reward: Tensor, group_index: Tensor, eps: float = 1e-6) -> Tensor:
    """GRPO: `(r - mean) / (std + eps)` within each group; 0 where the group's rewards are all equal; `[N]`."""
    mean, std, _ = group_stats(reward, group_index)
    return torch.where(std > 0, (reward - mean) / (std + eps), torch.zeros_like(reward))


def dr_grpo_advantages(reward: Tensor, group_index: Tensor) -> Tensor:
    """Dr.GRPO: `r - mean` within each group; `[N]`."""
    mean, _, _ = group_stats(reward, group_index)
    return reward - mean


def rloo_advantages(reward: Tensor, group_index: Tensor) -> Tensor:
    """RLOO: `r_i - mean_{j != i} r_j` = `n/(n-1) · (r_i - mean)`; 0 for a group of one; `[N]`."""
    mean, _, size = group_stats(reward, group_index)
    return torch.where(size > 1, (reward - mean) * size / (size - 1).clamp(min=1), torch.zeros_like(reward))


def token_rewards(
    reward: Tensor,
    seq_index: Tensor,
    action_mask: Tensor,
    kl: Tensor | None = None,
    kl_coef: float = 0.0,
) -> Tensor:
    """`[B, T]` rewards: each sample's reward on its last action token, minus `kl_coef · kl` on every
    action token (`kl [B, T]`, the per-token KL penalty, when given)."""
    n = reward.shape[0]
    dense, valid = to_sample_major(torch.zeros(action_mask.shape, dtype=reward.dtype), seq_index, action_mask, n)
    last = valid.sum(dim=1) - 1
    has = last >= 0  # a sample truncated to no action tokens has nowhere to put its reward
    dense[has.nonzero().squeeze(1), last[has]] = reward[has]
    out = from_sample_major(dense, seq_index, action_mask)
    if kl is not None and kl_coef:
        out = out - kl_coef * torch.where(action_mask, kl.to(out.dtype), torch.zeros((), dtype=out.dtype))
    return out


def discounted_returns(rewards: Tensor, seq_index: Tensor, action_mask: Tensor, n_samples: int, gamma: float) -> Tensor:
    """`G_t = r_t + γ · G_next` over each sample's action tokens (`rewards [B, T]`); `[B, T]`."""
    r, valid = to_sample_major(rewards, seq_index, action_mask, n_samples)
    out = torch.zeros_like(r)
    running = torch.zeros(n_samples, dtype=r.dtype)
    for t in reversed(range(r.shape[1])):
        running = torch.where(valid[:, t], r[:, t] + gamma * running, running)
        out[:, t] = running
    return from_sample_major(out, seq_index, action_mask)


def whiten(advantages: Tensor, action_mask: Tensor, eps: float = 1e-6) -> Tensor:
    """`(A - mean) / (std + eps)` over the action tokens (std with Bessel's correction), 0 elsewhere;
    all zeros with fewer than two action tokens (no spread to normalise by)."""
    x = advantages[action_mask]
    if x.numel() < 2:
        return torch.zeros_like(advantages)
    out = (advantages - x.mean()) / (x.std() + eps)
    return torch.where(action_mask, out, torch.zeros_like(out))


def reinforce_pp_advantages(
    rewards: Tensor, seq_index: Tensor, action_mask: Tensor, n_samples: int, gamma: float, eps: float = 1e-6
) -> tuple[Tensor, Tensor]:
    """REINFORCE++: returns of `rewards [B, T]` (which carry the KL penalty), whitened over all action
    tokens of the batch. Returns (advantages, returns), both `[B, T]`."""
    returns = discounted_returns(rewards, seq_index, action_mask, n_samples, gamma)
    return whiten(returns, action_mask, eps), returns


def gae(
    rewards: Tensor,
    values: Tensor,
    seq_index: Tensor,
    action_mask: Tensor,
    n_samples: int,
    gamma: float,
    lam: float,
) -> tuple[Tensor, Tensor]:
    """GAE over each sample's action tokens: `δ_t = r_t + γ V_next - V_t`, `A_t = δ_t + γλ A_next`,
    with `V_next = 0` after the last action. Returns (advantages, returns = advantages + values)."""
    r, valid = to_sample_major(rewards, seq_index, action_mask, n_samples)
    v, _ = to_sample_major(values.detach().to(rewards.dtype), seq_index, action_mask, n_samples)
    adv = torch.zeros_like(r)
    next_v = torch.zeros(n_samples, dtype=r.dtype)
    next_a = torch.zeros(n_samples, dtype=r.dtype)
    for t in reversed(range(r.shape[1])):
        delta = r[:, t] + gamma * next_v - v[:, t]
        a = delta + gamma * lam * next_a
        adv[:, t] = torch.where(valid[:, t], a, torch.zeros_like(a))
        next_v = torch.where(valid[:, t], v[:, t], next_v)
        next_a = torch.where(valid[:, t], a, next_a)
    advantages = from_sample_major(adv, seq_index, action_mask)
    return advantages, from_sample_major(adv + v, seq_index, action_mask)


def _reward_kl(exp: Experience, cfg: AlgorithmConfig) -> Tensor | None:
    """The per-token KL penalty for the reward (rollout policy vs reference), when configured."""
    if not (cfg.kl_in_reward and cfg.kl_coef > 0):
        return None
    if exp.base_log_probs is None:
        raise ValueError("algorithm.kl_in_reward needs base_log_probs: compute the reference log-probs first")
    return kl_estimate(exp.action_log_probs, exp.base_log_probs, cfg.kl_estimator)


def _sample_reward(exp: Experience, cfg: AlgorithmConfig) -> Tensor:
    """The scalar reward of group estimators; with `kl_in_reward`, minus the sample's summed KL."""
    kl = _reward_kl(exp, cfg)
    if kl is None:
        return exp.reward
    return exp.reward - cfg.kl_coef * sum_per_sample(kl, exp.seq_index, exp.action_mask, exp.num_samples)


def _group_estimator(fn: Callable[[Tensor, Tensor, AlgorithmConfig], Tensor]) -> Callable:
    def run(exp: Experience, cfg: AlgorithmConfig) -> tuple[Tensor, Tensor]:
        adv = fn(_sample_reward(exp, cfg), exp.group_index, cfg)
        returns = broadcast_to_tokens(exp.reward, exp.seq_index, exp.action_mask)
        return broadcast_to_tokens(adv, exp.seq_index, exp.action_mask), returns

    return run


def _reinforce_pp(exp: Experience, cfg: AlgorithmConfig) -> tuple[Tensor, Tensor]:
    rewards = token_rewards(exp.reward, exp.seq_index, exp.action_mask, _reward_kl(exp, cfg), cfg.kl_coef)
    returns = discounted_returns(rewards, exp.seq_index, exp.action_mask, exp.num_samples, cfg.gamma)
    return returns, returns  # whitened by `compute_advantages` (`cfg.whiten`)


def _reinforce_pp_baseline(exp: Experience, cfg: AlgorithmConfig) -> tuple[Tensor, Tensor]:
    """REINFORCE++-baseline: the group-mean reward subtracted first (the KL penalty stays per token)."""
    baselined = dr_grpo_advantages(exp.reward, exp.group_index)
    rewards = token_rewards(baselined, exp.seq_index, exp.action_mask, _reward_kl(exp, cfg), cfg.kl_coef)
    returns = discounted_returns(rewards, exp.seq_index, exp.action_mask, exp.num_samples, cfg.gamma)
    return returns, returns


def _gae(exp: Experience, cfg: AlgorithmConfig) -> tuple[Tensor, Tensor]:
    if exp.values is None:
        raise ValueError("algorithm.advantage = 'gae' needs critic values: fill Experience.values first")
    rewards = token_rewards(exp.reward, exp.seq_index, exp.action_mask, _reward_kl(exp, cfg), cfg.kl_coef)
    return gae(rewards, exp.values, exp.seq_index, exp.action_mask, exp.num_samples, cfg.gamma, cfg.lam)


AdvantageFn = Callable[[Experience, AlgorithmConfig], tuple[Tensor, Tensor]]
ADVANTAGES: dict[AdvantageKind, AdvantageFn] = {
    "grpo": _group_estimator(lambda r, g, cfg: grpo_advantages(r, g, cfg.adv_eps)),
    "dr_grpo": _group_estimator(lambda r, g, cfg: dr_grpo_advantages(r, g)),
    "rloo": _group_estimator(lambda r, g, cfg: rloo_advantages(r, g)),
    "reinforce_pp": _reinforce_pp,
    "reinforce_pp_baseline": _reinforce_pp_baseline,
    "gae": _gae,
}


def compute_advantages(exp: Experience, cfg: AlgorithmConfig) -> Experience:
    """Fill `exp.advantages` and `exp.returns` (`[B, T]`, 0 off action tokens) with `cfg.advantage`,
    the advantages whitened over the batch's action tokens when `cfg.whiten` (returns never are:
    they are the critic's targets)."""
    advantages, exp.returns = ADVANTAGES[cfg.advantage](exp, cfg)
    exp.advantages = whiten(advantages, exp.action_mask, cfg.adv_eps) if cfg.whiten else advantages
    return exp
