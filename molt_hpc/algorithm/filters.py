"""Group filters and reward shaping before advantages: dynamic sampling and the soft over-long penalty.

- Dynamic sampling (DAPO): a group whose rewards are all equal has zero group-relative advantage
  everywhere, so it only dilutes the token mean; `dynamic_sampling_filter` splits groups into kept and
  dropped (the caller counts and logs the dropped ones, and samples more to fill the step).
- Soft over-long penalty (DAPO): a response within `buffer` tokens of its length cap is penalised
  linearly, from 0 at `cap - buffer` to `-penalty` at the cap, and `-penalty` beyond it.
"""

import dataclasses
from collections.abc import Sequence

import torch
from torch import Tensor

from molt_hpc.trajectory import Group


def equal_reward_groups(reward: Tensor, group_index: Tensor, atol: float = 1e-6) -> Tensor:
    """`[G]` bool: True for groups whose rewards all lie within `atol` of each other."""
    g = int(group_index.max().item()) + 1
    r = reward.double()
    hi = torch.full((g,), -torch.inf, dtype=torch.float64).scatter_reduce(0, group_index, r, reduce="amax")
    lo = torch.full((g,), torch.inf, dtype=torch.float64).scatter_reduce(0, group_index, r, reduce="amin")
    return (hi - lo) <= atol


def has_signal(group: Group, atol: float = 1e-6) -> bool:
    """Whether the group's rewards differ (by more than `atol`), i.e. it carries a GRPO signal."""
    rewards = group.rewards
    return bool(rewards) and max(rewards) - min(rewards) > atol


def dynamic_sampling_filter(groups: Sequence[Group], atol: float = 1e-6) -> tuple[list[Group], list[Group]]:
    """(kept, dropped): groups with differing rewards, and groups whose rewards are all equal."""
    kept = [g for g in groups if has_signal(g, atol)]
    dropped = [g for g in groups if not has_signal(g, atol)]
    return kept, dropped


def overlong_penalty(lengths: Tensor, cap: Tensor | int, buffer: int, penalty: float) -> Tensor:
    """DAPO soft over-long penalty (values <= 0) for response `lengths` against length `cap`.

    `0` when `length <= cap - buffer`, `-penalty · (length - (cap - buffer)) / buffer` up to the cap,
    `-penalty` beyond it; all zeros when `buffer == 0`.
    """
    if buffer < 0 or penalty < 0:
        raise ValueError(f"overlong buffer and penalty must be >= 0, got buffer={buffer}, penalty={penalty}")
    lengths = lengths.double()
    if buffer == 0:
        return torch.zeros_like(lengths)
    cap = torch.as_tensor(cap, dtype=torch.float64)
    over = ((lengths - (cap - buffer)) / buffer).clamp(min=0.0, max=1.0)
    return -penalty * over


def apply_overlong_penalty(
    group: Group, max_total_tokens: int, buffer: int, penalty: float, max_response_tokens: int | None = None
) -> Group:
    """A copy of `group` whose rewards carry the over-long penalty.

    A sample's response is everything after its prompt; its cap is `max_total_tokens - prompt_len`,
    or `max_response_tokens` when that is smaller (single-turn: `rollout.max_new_tokens`). The penalty
    goes into `info["overlong_penalty"]`; `score` keeps the unpenalised value.
    """
    samples = group.samples
    lengths = torch.tensor([s.response_len for s in samples])
    caps = torch.tensor([max_total_tokens - s.prompt_len for s in samples])
    if max_response_tokens is not None:
        caps = caps.clamp(max=max_response_tokens)
    pens = overlong_penalty(lengths, caps, buffer, penalty).tolist()
    new = [
        dataclasses.replace(
            s,
            reward=s.reward + p,
            score=s.reward if s.score is None else s.score,
            info={**s.info, "overlong_penalty": p},
        )
        for s, p in zip(samples, pens, strict=True)
    ]
    return dataclasses.replace(group, samples=new)
