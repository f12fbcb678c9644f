"""The RL math of steps 4-7, as pure tensor functions the actor pool calls.

- `experience`: `make_experience(trajectories) -> Experience` (padded or packed tensors, action mask,
  rollout log-probs, versions, rewards) and the alignment conventions everything here shares;
- `advantage`: GRPO, Dr.GRPO, RLOO, REINFORCE++(-baseline), GAE, batch whitening; `compute_advantages(exp, cfg)`;
- `logprobs`: chunked per-token log-probs and entropy from hidden states or logits; `logprob_kernels`: the
  per-chunk math in three implementations (`actor.logprob_kernel`), `logprob_triton` its Triton kernels;
- `loss`: PPO / GSPO / CISPO policy loss with a decoupled IS correction, KL and entropy, aggregated
  over the global batch (`LossScale`, `global_loss_scale`; `global_token_count` for the token mean);
  clipped value loss;
- `kl`: k1/k2/k3/abs/mse estimators and the adaptive KL coefficient; `moe`: load balancing and router
  z-loss; `filters`: dynamic sampling and the over-long penalty; `segments`: token <-> sample layout
  helpers; `vision`: which samples keep which images, the drops (`vlm_truncation`, `media_token`) and
  multimodal positions of a batch; `distill`: on-policy distillation's per-token advantages (teacher -
  student log-prob, alone or added to the env's) and its metrics; `reward_model`: a reward model's score
  combined with the env's reward.
- `mismatch`: the train–inference mismatch observatory (the trainer's log-probs against the engine's for the
  same tokens and the same weights);
- `supervised`: the losses of the stages beyond RL, SFT's token mean and Bradley-Terry.
"""

from molt_hpc.algorithm.advantage import ADVANTAGES, compute_advantages
from molt_hpc.algorithm.experience import Experience, experience_from_groups, make_experience
from molt_hpc.algorithm.filters import apply_overlong_penalty, dynamic_sampling_filter, overlong_penalty
from molt_hpc.algorithm.kl import kl_estimate
from molt_hpc.algorithm.logprobs import token_logprobs
from molt_hpc.algorithm.loss import (
    POLICY_LOSSES,
    LossScale,
    global_loss_scale,
    global_token_count,
    policy_loss,
    policy_mask,
    value_loss,
)
from molt_hpc.algorithm.moe import load_balancing_loss, router_z_loss

__all__ = [
    "ADVANTAGES",
    "POLICY_LOSSES",
    "Experience",
    "LossScale",
    "apply_overlong_penalty",
    "compute_advantages",
    "dynamic_sampling_filter",
    "experience_from_groups",
    "global_loss_scale",
    "global_token_count",
    "kl_estimate",
    "load_balancing_loss",
    "make_experience",
    "overlong_penalty",
    "policy_loss",
    "policy_mask",
    "router_z_loss",
    "token_logprobs",
    "value_loss",
]
