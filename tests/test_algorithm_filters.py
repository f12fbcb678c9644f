"""Dynamic sampling and the soft over-long penalty."""

import pytest
import torch

from molt_hpc.algorithm.filters import (
    apply_overlong_penalty,
    dynamic_sampling_filter,
    equal_reward_groups,
    overlong_penalty,
)
from molt_hpc.trajectory import Group, Trajectory


def sample(reward: float, prompt_len: int = 2, response_len: int = 3) -> Trajectory:
    n = prompt_len + response_len
    return Trajectory(
        tokens=list(range(n)),
        prompt_len=prompt_len,
        action_ranges=[(prompt_len, n)],
        action_logprobs=[0.0] * response_len,
        versions=[0] * response_len,
        reward=reward,
    )


def group(gid: str, rewards: list[float]) -> Group:
    return Group(gid, gid, [sample(r) for r in rewards])


def test_dynamic_sampling_drops_groups_with_equal_rewards():
    groups = [group("a", [1, 1, 1]), group("b", [0, 1, 0]), group("c", [0.3, 0.1 + 0.2]), group("d", [0, 0])]
    kept, dropped = dynamic_sampling_filter(groups)
    assert [g.group_id for g in kept] == ["b"]
    assert [g.group_id for g in dropped] == ["a", "c", "d"]


def test_equal_reward_groups_on_tensors():
    reward = torch.tensor([1.0, 1.0, 0.0, 1.0, 2.0, 5.0])
    index = torch.tensor([0, 0, 1, 1, 2, 3])
    assert equal_reward_groups(reward, index).tolist() == [True, False, True, True]


def test_overlong_penalty_is_linear_in_the_buffer():
    lengths = torch.tensor([50, 80, 85, 90, 100, 120])
    got = overlong_penalty(lengths, cap=100, buffer=20, penalty=2.0)
    # 0 up to cap - buffer = 80, then -2 · (L - 80) / 20, then -2 beyond the cap
    assert got.tolist() == pytest.approx([0, 0, -0.5, -1.0, -2.0, -2.0])
    assert overlong_penalty(lengths, cap=100, buffer=0, penalty=2.0).tolist() == [0.0] * 6
    with pytest.raises(ValueError, match="buffer"):
        overlong_penalty(lengths, cap=100, buffer=-1, penalty=1.0)


def test_apply_overlong_penalty_to_a_group_keeps_the_score():
    g = Group("g", "p", [sample(1.0, prompt_len=10, response_len=25), sample(0.0, prompt_len=10, response_len=5)])
    out = apply_overlong_penalty(g, max_total_tokens=40, buffer=10, penalty=1.0)
    # cap = 40 - 10 = 30: response 25 is half-way through the buffer [20, 30]
    assert out.rewards == pytest.approx([0.5, 0.0])
    assert out.samples[0].score == 1.0 and out.samples[0].info["overlong_penalty"] == pytest.approx(-0.5)
    assert g.rewards == [1.0, 0.0]  # the input is not modified
    single_turn = apply_overlong_penalty(g, max_total_tokens=40, buffer=10, penalty=1.0, max_response_tokens=16)
    # cap = min(30, 16): response 25 is beyond it, response 5 is before the buffer [6, 16]
    assert single_turn.rewards == pytest.approx([0.0, 0.0])
    assert [s.info["overlong_penalty"] for s in single_turn.samples] == pytest.approx([-1.0, 0.0])
