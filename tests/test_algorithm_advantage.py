"""Advantages: hand-worked group cases, Python-loop references for GAE / REINFORCE++, invariants."""

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from molt_hpc.algorithm.advantage import (
    ADVANTAGES,
    compute_advantages,
    discounted_returns,
    dr_grpo_advantages,
    gae,
    grpo_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
    token_rewards,
)
from molt_hpc.algorithm.experience import make_experience
from molt_hpc.algorithm.kl import kl_estimate
from molt_hpc.config.train import AdvantageKind, AlgorithmConfig
from molt_hpc.trajectory import Trajectory

REWARD = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 5.0, 3.0])
GROUP = torch.tensor([0, 0, 0, 0, 1, 1, 1, 2])


def test_grpo_hand_worked():
    s0, s1 = math.sqrt(1 / 3), math.sqrt(3)  # Bessel-corrected stds of [1,0,0,1] and [2,2,5]
    expected = [0.5 / s0, -0.5 / s0, -0.5 / s0, 0.5 / s0, -1 / s1, -1 / s1, 2 / s1, 0.0]
    assert grpo_advantages(REWARD, GROUP, eps=0.0).tolist() == pytest.approx(expected, abs=1e-6)


def test_dr_grpo_and_rloo_hand_worked():
    assert dr_grpo_advantages(REWARD, GROUP).tolist() == pytest.approx([0.5, -0.5, -0.5, 0.5, -1, -1, 2, 0])
    # r_i minus the mean of the others; a group of one has no baseline and gets 0
    expected = [1 - 1 / 3, -2 / 3, -2 / 3, 1 - 1 / 3, 2 - 3.5, 2 - 3.5, 5 - 2, 0.0]
    assert rloo_advantages(REWARD, GROUP).tolist() == pytest.approx(expected, abs=1e-6)


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(1, 9), min_size=1, max_size=6), seed=st.integers(0, 2**31 - 1))
def test_group_advantages_sum_to_zero_per_group(sizes, seed):
    g = torch.Generator().manual_seed(seed)
    group = torch.cat([torch.full((n,), i) for i, n in enumerate(sizes)])
    reward = torch.randn(len(group), generator=g) * 3 + torch.randint(0, 2, (len(group),), generator=g)
    for fn in (lambda r, gi: grpo_advantages(r, gi), dr_grpo_advantages, rloo_advantages):
        adv = fn(reward, group)
        sums = torch.zeros(len(sizes), dtype=torch.float64).index_add(0, group, adv.double())
        assert sums.abs().max().item() < 1e-4


def random_trajectories(rng: random.Random, n: int) -> list[Trajectory]:
    """Multi-turn trajectories: prompt, then 1-3 turns of action + env feedback."""
    out = []
    for _ in range(n):
        tokens = [5] * rng.randint(1, 4)
        ranges = []
        for turn in range(rng.randint(1, 3)):
            if turn:
                tokens += [6] * rng.randint(1, 3)  # env feedback
            start = len(tokens)
            tokens += [7] * rng.randint(1, 4)
            ranges.append((start, len(tokens)))
        n_act = sum(e - s for s, e in ranges)
        lp = [-rng.random() for _ in range(n_act)]
        out.append(Trajectory(tokens, ranges[0][0], ranges, lp, [0] * n_act, reward=rng.uniform(-1, 2)))
    return out


def reference_per_sample(exp, tensor) -> list[list[float]]:
    """A [B, T] tensor read back as each sample's action-token values, by a plain loop over tokens."""
    out = [[] for _ in range(exp.num_samples)]
    for b in range(exp.sequences.shape[0]):
        for t in range(exp.sequences.shape[1]):
            if exp.action_mask[b, t]:
                out[exp.seq_index[b, t].item()].append(float(tensor[b, t]))
    return out


def flatten(xs: list[list[float]]) -> list[float]:
    return [x for row in xs for x in row]


def loop_gae(rewards: list[float], values: list[float], gamma: float, lam: float) -> list[float]:
    adv, last = [0.0] * len(rewards), 0.0
    for t in reversed(range(len(rewards))):
        next_v = values[t + 1] if t + 1 < len(rewards) else 0.0
        delta = rewards[t] + gamma * next_v - values[t]
        last = delta + gamma * lam * last
        adv[t] = last
    return adv


@pytest.mark.parametrize("pack", [False, True])
def test_gae_matches_a_python_loop_over_action_tokens(pack):
    rng = random.Random(1)
    exp = make_experience(random_trajectories(rng, 7), max_len=24, pack=pack)
    values = torch.randn(exp.sequences.shape, generator=torch.Generator().manual_seed(2))
    kl = torch.rand(exp.sequences.shape, generator=torch.Generator().manual_seed(3))
    gamma, lam, kl_coef = 0.9, 0.8, 0.05
    rewards = token_rewards(exp.reward, exp.seq_index, exp.action_mask, kl, kl_coef)
    adv, ret = gae(rewards, values, exp.seq_index, exp.action_mask, exp.num_samples, gamma, lam)
    v_per, kl_per = reference_per_sample(exp, values), reference_per_sample(exp, kl)
    for n, (a, r) in enumerate(zip(reference_per_sample(exp, adv), reference_per_sample(exp, ret), strict=True)):
        rew = [-kl_coef * k for k in kl_per[n]]
        rew[-1] += exp.reward[n].item()  # the reward sits on the last action token
        expected = loop_gae(rew, v_per[n], gamma, lam)
        assert a == pytest.approx(expected, abs=1e-5)
        assert r == pytest.approx([x + v for x, v in zip(expected, v_per[n], strict=True)], abs=1e-5)
    assert (adv[~exp.action_mask] == 0).all() and (ret[~exp.action_mask] == 0).all()


def test_token_rewards_on_the_last_action_token_of_a_multi_turn_sample():
    t = Trajectory([1, 2, 3, 4, 5, 6, 7], 1, [(1, 3), (5, 6)], [0.0] * 3, [0] * 3, reward=2.5)
    exp = make_experience([t], max_len=16)
    r = token_rewards(exp.reward, exp.seq_index, exp.action_mask)
    assert r.tolist() == [[0, 0, 0, 0, 0, 2.5, 0]]


def test_reinforce_pp_matches_a_python_loop():
    rng = random.Random(4)
    exp = make_experience(random_trajectories(rng, 6), max_len=24, pack=True)
    kl = torch.rand(exp.sequences.shape, generator=torch.Generator().manual_seed(5))
    gamma, coef = 0.95, 0.1
    rewards = token_rewards(exp.reward, exp.seq_index, exp.action_mask, kl, coef)
    adv, ret = reinforce_pp_advantages(rewards, exp.seq_index, exp.action_mask, exp.num_samples, gamma, eps=0.0)
    expected_returns = []
    for n, ks in enumerate(reference_per_sample(exp, kl)):
        rew = [-coef * k for k in ks]
        rew[-1] += exp.reward[n].item()
        g, rs = 0.0, []
        for x in reversed(rew):
            g = x + gamma * g
            rs.append(g)
        expected_returns.append(rs[::-1])
    flat = [x for rs in expected_returns for x in rs]
    assert flatten(reference_per_sample(exp, ret)) == pytest.approx(flat, abs=1e-5)
    mean = sum(flat) / len(flat)
    std = math.sqrt(sum((x - mean) ** 2 for x in flat) / (len(flat) - 1))
    assert flatten(reference_per_sample(exp, adv)) == pytest.approx([(x - mean) / std for x in flat], abs=1e-4)


def test_discounted_returns_gamma_one_is_the_reward_to_go():
    exp = make_experience(random_trajectories(random.Random(6), 3), max_len=24)
    rewards = token_rewards(exp.reward, exp.seq_index, exp.action_mask)
    ret = discounted_returns(rewards, exp.seq_index, exp.action_mask, exp.num_samples, 1.0)
    for n, rs in enumerate(reference_per_sample(exp, ret)):
        assert rs == pytest.approx([exp.reward[n].item()] * len(rs))


@pytest.mark.parametrize("kind", list(ADVANTAGES))
def test_compute_advantages_dispatch(kind: AdvantageKind):
    trajs = random_trajectories(random.Random(7), 6)
    for i, t in enumerate(trajs):
        t.group_id = f"g{i // 3}"
    exp = make_experience(trajs, max_len=24)
    cfg = AlgorithmConfig(advantage=kind, adv_eps=1e-6)
    if kind == "gae":
        with pytest.raises(ValueError, match="critic values"):
            compute_advantages(exp, cfg)
        exp.values = torch.zeros(exp.sequences.shape)
    compute_advantages(exp, cfg)
    assert exp.advantages.shape == exp.sequences.shape
    assert (exp.advantages[~exp.action_mask] == 0).all()
    if kind == "grpo":
        per_sample = grpo_advantages(exp.reward, exp.group_index)
        for n, a in enumerate(reference_per_sample(exp, exp.advantages)):
            assert a == pytest.approx([per_sample[n].item()] * len(a))


def test_kl_in_reward_for_group_estimators_subtracts_the_summed_kl():
    trajs = random_trajectories(random.Random(8), 4)
    exp = make_experience(trajs, max_len=24)
    exp.base_log_probs = exp.action_log_probs - 0.3 * exp.action_mask
    cfg = AlgorithmConfig(advantage="dr_grpo", kl_coef=0.5, kl_in_reward=True, kl_estimator="k1")
    compute_advantages(exp, cfg)
    # k1 = log p - log p_ref = 0.3 per action token
    n_act = [sum(e - s for s, e in t.action_ranges) for t in trajs]
    shaped = torch.tensor([t.reward - 0.5 * 0.3 * n for t, n in zip(trajs, n_act, strict=True)])
    expected = (shaped - shaped.mean()).tolist()
    got = [a[0] for a in reference_per_sample(exp, exp.advantages)]
    assert got == pytest.approx(expected, abs=1e-5)
    exp.base_log_probs = None
    with pytest.raises(ValueError, match="base_log_probs"):
        compute_advantages(exp, cfg)


def test_reinforce_pp_with_kl_in_reward_uses_the_rollout_vs_reference_kl():
    exp = make_experience(random_trajectories(random.Random(9), 5), max_len=24)
    noise = torch.randn(exp.sequences.shape, generator=torch.Generator().manual_seed(10))
    exp.base_log_probs = exp.action_log_probs + 0.2 * noise
    cfg = AlgorithmConfig(advantage="reinforce_pp", kl_coef=0.05, kl_in_reward=True, kl_estimator="k2", gamma=0.9)
    compute_advantages(exp, cfg)
    kl = 0.5 * (0.2 * noise) ** 2  # k2 of log r = log p_ref - log p
    rewards = token_rewards(exp.reward, exp.seq_index, exp.action_mask, kl, 0.05)
    adv, ret = reinforce_pp_advantages(rewards, exp.seq_index, exp.action_mask, exp.num_samples, 0.9, cfg.adv_eps)
    assert torch.allclose(exp.advantages, adv, atol=1e-5) and torch.allclose(exp.returns, ret, atol=1e-5)
    no_kl = compute_advantages(
        make_experience(random_trajectories(random.Random(9), 5), max_len=24),
        cfg.model_copy(update={"kl_in_reward": False}),
    )
    assert not torch.allclose(no_kl.returns, ret)  # the penalty did change the returns


def test_kl_estimators_hand_worked():
    logp, ref = torch.tensor([-1.0]), torch.tensor([-1.5])  # log r = log p_ref - log p = -0.5
    assert kl_estimate(logp, ref, "k1").item() == pytest.approx(0.5)
    assert kl_estimate(logp, ref, "k2").item() == pytest.approx(0.125)
    assert kl_estimate(logp, ref, "k3").item() == pytest.approx(math.exp(-0.5) - 1 + 0.5)
