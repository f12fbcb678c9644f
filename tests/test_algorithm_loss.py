"""Policy and value losses: hand-worked cases, IS correction, KL and entropy terms, MoE auxiliary losses."""

import math

import pytest
import torch

from molt_hpc.algorithm.loss import global_token_count, policy_loss, value_loss
from molt_hpc.algorithm.moe import load_balancing_loss, router_z_loss
from molt_hpc.config.train import AlgorithmConfig

NO_IS = {"is_correction": "none"}


def leaf(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64, requires_grad=True)


def run(cfg: AlgorithmConfig, log_ratio, adv, mask=None, seq_index=None, **kw):
    """Loss and d loss / d logp for one row of tokens whose rollout log-probs are 0."""
    logp = leaf([log_ratio])
    adv_t = torch.tensor([adv], dtype=torch.float64)
    mask_t = torch.ones_like(adv_t, dtype=torch.bool) if mask is None else torch.tensor([mask])
    seq = None if seq_index is None else torch.tensor([seq_index])
    count = int(mask_t.sum())
    loss, metrics = policy_loss(logp, torch.zeros_like(logp), adv_t, mask_t, cfg, count, seq_index=seq, **kw)
    loss.backward()
    return loss.item(), logp.grad[0].tolist(), metrics


def test_ppo_clip_higher_and_dual_clip_hand_worked():
    cfg = AlgorithmConfig(eps_low=0.2, eps_high=0.28, dual_clip=3.0, **NO_IS)
    r = [1.5, 0.5, 1.1, 0.7, 4.0]
    adv = [1.0, 1.0, -1.0, -1.0, -2.0]
    loss, grad, m = run(cfg, [math.log(x) for x in r], adv)
    # per token: clipped at 1.28 | unclipped 0.5 | unclipped -1.1 | clipped at 0.8 | dual-clipped at 3·2
    assert loss == pytest.approx((-1.28 - 0.5 + 1.1 + 0.8 + 6.0) / 5)
    # d/dlogp of -r·A/5 where unclipped, 0 where a clip is active
    assert grad == pytest.approx([0.0, -0.5 / 5, 1.1 / 5, 0.0, 0.0])
    assert m["clip_frac"].item() == pytest.approx(3 / 5)
    assert m["ratio_max"].item() == pytest.approx(4.0) and m["ratio_min"].item() == pytest.approx(0.5)
    assert m["ratio_mean"].item() == pytest.approx(sum(r) / 5)
    # k3 of KL(current || rollout): with q/p = 1/r per token, (1/r - 1) - log(1/r)
    assert m["kl_rollout"].item() == pytest.approx(sum(1 / x - 1 + math.log(x) for x in r) / 5)


def test_gspo_uses_the_sequence_geometric_mean_ratio():
    cfg = AlgorithmConfig(policy_loss="gspo", eps_low=0.2, eps_high=0.28, loss_agg="token-mean", **NO_IS)
    # two samples in one packed row: mean log-ratio 0.2 (unclipped) and 0.6 (clipped at 1.28)
    loss, grad, m = run(cfg, [0.1, 0.3, 0.5, 0.7], [1.0] * 4, seq_index=[0, 0, 1, 1])
    s0 = math.exp(0.2)
    assert loss == pytest.approx((-2 * s0 - 2 * 1.28) / 4)
    assert grad == pytest.approx([-s0 / 4, -s0 / 4, 0.0, 0.0])
    assert m["clip_frac"].item() == pytest.approx(0.5)


def test_cispo_keeps_a_gradient_on_clipped_tokens():
    cfg = AlgorithmConfig(policy_loss="cispo", eps_high=0.28, **NO_IS)
    loss, grad, m = run(cfg, [math.log(1.5), math.log(0.5)], [1.0, -1.0])
    assert loss == pytest.approx(-(1.28 * math.log(1.5) + 0.5 * -1 * math.log(0.5)) / 2)
    assert grad == pytest.approx([-1.28 / 2, 0.5 / 2])
    assert m["clip_frac"].item() == pytest.approx(0.5)


@pytest.mark.parametrize(
    ("correction", "expected_loss", "expected_grad"),
    [("none", 1.0, 1.0), ("truncate", 2.0, 2.0), ("mask", 0.0, 0.0)],
)
def test_token_is_correction_is_a_factor_of_old_over_engine(correction, expected_loss, expected_grad):
    cfg = AlgorithmConfig(is_correction=correction, is_threshold=2.0, eps_low=0.2, eps_high=0.28)
    # the loss's ratio p / p_old is 1 (on the old policy); w = p_old / p_engine = 3 > C = 2 on token 0, A = -1
    logp = leaf([[math.log(3.0), 0.0]])
    old = logp.detach().clone()
    adv, mask = torch.tensor([[-1.0, 0.0]], dtype=torch.float64), torch.ones(1, 2, dtype=torch.bool)
    loss, m = policy_loss(logp, torch.zeros(1, 2, dtype=torch.float64), adv, mask, cfg, 2, old_log_probs=old)
    loss.backward()
    # PPO at r = 1: loss |A| = 1 per token, gradient weight r = 1; truncate: x min(3, 2); mask: dropped
    assert loss.item() == pytest.approx(expected_loss / 2)
    assert logp.grad[0, 0].item() == pytest.approx(expected_grad / 2)
    assert m["is_over_threshold_frac"].item() == pytest.approx(0.5)
    assert m["is_weight_max"].item() == pytest.approx(3.0)


def test_sequence_is_correction_weighs_every_token_of_the_sample():
    cfg = AlgorithmConfig(is_correction="truncate", is_level="sequence", is_threshold=2.0, eps_high=0.28)
    # sample 0: geometric mean of w sqrt(9 · 1) = 3 -> both tokens x min(3, 2) = 2; sample 1 has w = 1
    old = torch.tensor([[math.log(9.0), 0.0, 0.0]], dtype=torch.float64)
    engine = torch.zeros(1, 3, dtype=torch.float64)
    adv, seq = torch.tensor([[-1.0, -1.0, -1.0]], dtype=torch.float64), torch.tensor([[0, 0, 1]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    logp = leaf(old.tolist())
    loss, _ = policy_loss(logp, engine, adv, mask, cfg, 3, seq_index=seq, old_log_probs=old)
    loss.backward()
    assert loss.item() == pytest.approx((2.0 + 2.0 + 1.0) / 3)
    assert logp.grad[0].tolist() == pytest.approx([2 / 3, 2 / 3, 1 / 3])


def test_kl_in_the_loss_and_the_entropy_bonus():
    cfg = AlgorithmConfig(kl_coef=0.1, kl_estimator="k3", entropy_coef=0.01, **NO_IS)
    logp = leaf([[-1.0, -2.0]])
    ref = torch.tensor([[-1.5, -1.0]], dtype=torch.float64)
    ent = torch.tensor([[2.0, 3.0]], dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=torch.bool)
    zeros = torch.zeros(1, 2, dtype=torch.float64)
    loss, m = policy_loss(logp, logp.detach(), zeros, mask, cfg, 2, base_log_probs=ref, entropy=ent)
    loss.backward()
    log_r = [-0.5, 1.0]  # log p_ref - log p
    k3 = [math.exp(x) - 1 - x for x in log_r]
    assert loss.item() == pytest.approx((0.1 * sum(k3) - 0.01 * 5.0) / 2)
    # d k3 / d logp = 1 - exp(log r)
    assert logp.grad[0].tolist() == pytest.approx([0.1 * (1 - math.exp(x)) / 2 for x in log_r])
    assert m["kl"].item() == pytest.approx(sum(k3) / 2) and m["entropy"].item() == pytest.approx(2.5)
    with pytest.raises(ValueError, match="base_log_probs"):
        policy_loss(logp, logp.detach(), zeros, mask, cfg, 2)
    in_reward = AlgorithmConfig(kl_coef=0.1, kl_in_reward=True, **NO_IS)
    loss, _ = policy_loss(logp, logp.detach(), zeros, mask, in_reward, 2)
    assert loss.item() == 0.0  # the KL went into the reward, not the loss


def test_value_loss_hand_worked():
    v = leaf([[1.0, 2.0, 9.0]])
    old = torch.tensor([[0.5, 2.0, 0.0]])
    ret = torch.tensor([[2.0, 1.0, 0.0]])
    mask = torch.tensor([[True, True, False]])
    loss, m = value_loss(v, old, ret, mask, token_count=2, clip=0.2)
    loss.backward()
    # token 0: max((1-2)^2, (0.7-2)^2) = 1.69 (clipped term); token 1: max(1, 1) = 1; token 2 masked
    assert loss.item() == pytest.approx((0.5 * 1.69 + 0.5 * 1.0) / 2)
    # the clipped term does not depend on v (clip active) -> 0; token 1: (v - R) / 2
    assert v.grad[0].tolist() == pytest.approx([0.0, 0.5, 0.0])
    assert m["value_clip_frac"].item() == pytest.approx(0.5)


def test_bad_token_count_is_refused():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="token_count"):
        policy_loss(x, x, x, x.bool(), AlgorithmConfig(), 0)
    with pytest.raises(ValueError, match="token_count"):
        value_loss(x, x, x, x.bool(), 0)


def test_global_token_count_without_a_process_group():
    masks = [torch.tensor([[True, False, True]]), torch.tensor([[True, True, True]])]
    assert global_token_count(masks) == 5
    assert global_token_count(masks[0]) == 2


def test_load_balancing_hand_worked():
    logits = torch.tensor([[2.0, 0.0], [1.0, 0.0], [0.0, 1.0], [9.0, -9.0]], requires_grad=True)
    mask = torch.tensor([True, True, True, False])  # the last token is padding
    loss = load_balancing_loss(logits, top_k=1, token_mask=mask)
    p = [[1 / (1 + math.exp(-d)), 1 - 1 / (1 + math.exp(-d))] for d in (2.0, 1.0, -1.0)]
    mean_p = [sum(row[i] for row in p) / 3 for i in range(2)]
    f = [2 / 3, 1 / 3]  # top-1 picks expert 0, 0, 1
    assert loss.item() == pytest.approx(2 * (f[0] * mean_p[0] + f[1] * mean_p[1]), abs=1e-6)
    loss.backward()
    assert logits.grad[3].abs().max().item() == 0.0
    # router replay: the engine's choice replaces the top-k
    replay = load_balancing_loss(logits, 1, mask, selected_experts=torch.tensor([[1], [1], [1], [0]]))
    assert replay.item() == pytest.approx(2 * mean_p[1], abs=1e-6)
    # a perfectly balanced router scores 1 whatever top_k
    uniform = torch.zeros(8, 4)
    assert load_balancing_loss([uniform, uniform], top_k=2).item() == pytest.approx(1.0)


def test_router_z_loss_hand_worked():
    logits = torch.tensor([[0.0, 0.0], [1.0, 2.0], [5.0, 5.0]])
    expected = [math.log(2) ** 2, math.log(math.e + math.e**2) ** 2]
    assert router_z_loss(logits, torch.tensor([True, True, False])).item() == pytest.approx(sum(expected) / 2)
    assert router_z_loss([logits[:2], logits[:2]]).item() == pytest.approx(sum(expected) / 2)
