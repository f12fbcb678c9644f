"""The RL math against the papers' formulas, each recomputed here in float64 with plain Python loops:
decoupled IS correction (CISPO, GSPO, PPO), loss aggregation modes, GAE whitening, REINFORCE++-baseline,
CISPO's lower clip, the adaptive KL controller, the abs / mse KL estimators."""

import math
import random

import pytest
import torch

from molt_hpc.algorithm.advantage import compute_advantages, gae, whiten
from molt_hpc.algorithm.experience import make_experience
from molt_hpc.algorithm.kl import adaptive_kl_coef, kl_estimate
from molt_hpc.algorithm.loss import LossScale, global_loss_scale, policy_loss, policy_mask
from molt_hpc.config.train import AlgorithmConfig
from molt_hpc.trajectory import Trajectory

# Three samples packed in one row with a padding tail: lengths 3, 1, 2 (sample -1 is padding).
SEQ = [0, 0, 0, 1, 2, 2, -1]
LOGP = [-0.2, -1.5, -0.9, -0.1, -2.0, -0.7, 0.0]
OLD = [-0.9, -1.1, -0.9, -0.4, -1.0, -0.8, 0.0]
ENGINE = [-1.2, -1.0, -2.2, -0.4, -1.1, -0.6, 0.0]
ADV = [1.0, 1.0, 1.0, -0.5, 2.0, 2.0, 0.0]


def tensors():
    mask = torch.tensor([[s >= 0 for s in SEQ]])
    f = lambda v: torch.tensor([v], dtype=torch.float64)  # noqa: E731
    return mask, torch.tensor([SEQ]), f(LOGP), f(OLD), f(ENGINE), f(ADV)


def samples():
    return {s: [t for t, x in enumerate(SEQ) if x == s] for s in range(3)}


def run(cfg, scale, old=True):
    mask, seq, logp, old_t, engine, adv = tensors()
    x = logp.clone().requires_grad_(True)
    loss, m = policy_loss(x, engine, adv, mask, cfg, scale, seq_index=seq, n_samples=3,
                          old_log_probs=old_t if old else None)  # fmt: skip
    loss.backward()
    return loss.item(), x.grad[0].tolist(), m


def clip(x, lo, hi):
    return min(max(x, lo), hi)


def test_cispo_weight_is_min_r_one_plus_eps_high_alone_without_old_logprobs():
    # MiniMax-M1 eq. 4: J = 1/T Σ sg(min(r, 1 + eps_high)) · A · log r, r = p / p_engine; no other factor
    cfg = AlgorithmConfig(policy_loss="cispo", eps_high=0.28, is_correction="none")
    loss, grad, _ = run(cfg, 6.0, old=False)
    r = [math.exp(LOGP[t] - ENGINE[t]) for t in range(6)]
    assert loss == pytest.approx(-sum(min(r[t], 1.28) * ADV[t] * (LOGP[t] - ENGINE[t]) for t in range(6)) / 6)
    assert grad[:6] == pytest.approx([-min(r[t], 1.28) * ADV[t] / 6 for t in range(6)])
    assert max(r) > 2.56  # the case where a second factor min(1, 2/r) used to shrink the weight to 2.56 / r


def test_cispo_with_truncated_is_multiplies_by_min_w_c_of_old_over_engine():
    cfg = AlgorithmConfig(policy_loss="cispo", eps_high=0.28, cispo_eps_low=0.3, is_correction="truncate",
                          is_threshold=1.5)  # fmt: skip
    loss, grad, _ = run(cfg, 6.0)
    want_loss, want_grad = 0.0, []
    for t in range(6):
        r, w = math.exp(LOGP[t] - OLD[t]), math.exp(OLD[t] - ENGINE[t])
        weight = clip(r, 0.7, 1.28) * min(w, 1.5)
        want_loss -= weight * ADV[t] * (LOGP[t] - OLD[t]) / 6
        want_grad.append(-weight * ADV[t] / 6)
    assert loss == pytest.approx(want_loss) and grad[:6] == pytest.approx(want_grad)


def test_ppo_decoupled_truncated_is():
    # decoupled PPO: -min(r A, clip(r) A) · min(w, C), r = p / p_old, w = p_old / p_engine
    cfg = AlgorithmConfig(eps_low=0.2, eps_high=0.28, is_correction="truncate", is_threshold=1.5)
    loss, grad, _ = run(cfg, 6.0)
    want_loss, want_grad = 0.0, []
    for t in range(6):
        r, w, a = math.exp(LOGP[t] - OLD[t]), min(math.exp(OLD[t] - ENGINE[t]), 1.5), ADV[t]
        unclipped, clipped = r * a, clip(r, 0.8, 1.28) * a
        want_loss -= min(unclipped, clipped) * w / 6
        want_grad.append(-r * a * w / 6 if unclipped <= clipped else 0.0)
    assert loss == pytest.approx(want_loss) and grad[:6] == pytest.approx(want_grad)


def test_gspo_sequence_truncated_is_and_its_default_sequence_mean():
    # GSPO eq. 5-7: J = 1/G Σ_i min(s_i A_i, clip(s_i) A_i), s_i = (Π p/p_old)^(1/|y_i|); IS x min(w_i, C)
    cfg = AlgorithmConfig(policy_loss="gspo", eps_low=0.2, eps_high=0.28, is_correction="truncate",
                          is_level="sequence", is_threshold=1.2)  # fmt: skip
    assert cfg.aggregation == "seq-mean-token-mean"
    loss, _, _ = run(cfg, LossScale(6, 3))
    want = 0.0
    for toks in samples().values():
        s = math.exp(sum(LOGP[t] - OLD[t] for t in toks) / len(toks))
        w = math.exp(sum(OLD[t] - ENGINE[t] for t in toks) / len(toks))
        a = ADV[toks[0]]
        want -= min(s * a, clip(s, 0.8, 1.28) * a) * min(w, 1.2) / 3
    assert loss == pytest.approx(want)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_loss_aggregation_modes(agg):
    cfg = AlgorithmConfig(loss_agg=agg, is_correction="none")
    # other micro-batches hold 10 more tokens in 2 more samples; the Dr.GRPO constant is 16
    loss, _, _ = run(cfg, LossScale(16, 5, 16), old=False)
    # PPO-clip per token, r = p / p_engine
    per_token = [-min(math.exp(LOGP[t] - ENGINE[t]) * ADV[t], clip(math.exp(LOGP[t] - ENGINE[t]), 0.8, 1.28) * ADV[t])
                 for t in range(6)]  # fmt: skip
    sums = {s: sum(per_token[t] for t in toks) for s, toks in samples().items()}
    want = {
        "token-mean": sum(per_token) / 16,
        "seq-mean-token-sum": sum(sums.values()) / 5,
        "seq-mean-token-mean": sum(sums[s] / len(toks) for s, toks in samples().items()) / 5,
        "seq-mean-token-sum-norm": sum(sums.values()) / (5 * 16),
    }[agg]
    assert loss == pytest.approx(want)


def test_global_loss_scale_counts_samples_not_rows():
    mask, seq, *_ = tensors()
    assert global_loss_scale([mask, mask[:, :4]], [seq, seq[:, :4]], 7) == LossScale(6 + 4, 3 + 2, 7)


def test_sequence_mask_drops_the_sample_from_every_denominator():
    # sample 2's geometric-mean w = exp(mean(-1+1.1, -0.8+0.6)) ~ 0.95; sample 0's exp((0.3-0.1+1.3)/3) = 1.65 > 1.5
    cfg = AlgorithmConfig(is_correction="mask", is_level="sequence", is_threshold=1.5, loss_agg="seq-mean-token-mean")
    mask, seq, _, old, engine, _ = tensors()
    kept = policy_mask(mask, engine, cfg, old_log_probs=old, seq_index=seq, n_samples=3)
    assert kept[0].tolist() == [False, False, False, True, True, True, False]
    scale = global_loss_scale([kept], [seq])
    assert scale == LossScale(3, 2, 0)
    loss, _, _ = run(cfg, scale)
    want = 0.0
    for toks in (samples()[1], samples()[2]):
        per = [-min(math.exp(LOGP[t] - OLD[t]) * ADV[t], clip(math.exp(LOGP[t] - OLD[t]), 0.8, 1.28) * ADV[t])
               for t in toks]  # fmt: skip
        want += sum(per) / len(toks) / 2
    assert loss == pytest.approx(want)


def test_gspo_token_is_and_engine_correction_are_refused():
    with pytest.raises(ValueError, match="is_level = 'sequence'"):
        AlgorithmConfig(policy_loss="gspo", is_correction="truncate")
    with pytest.raises(ValueError, match="old_log_probs"):
        AlgorithmConfig(is_correction="truncate", old_log_probs="engine")
    assert AlgorithmConfig(is_correction="truncate").recompute_old(1)
    assert not AlgorithmConfig().recompute_old(1) and AlgorithmConfig().recompute_old(2)
    assert not AlgorithmConfig(old_log_probs="engine").recompute_old(4)


def _gae_loop(rewards, values, gamma, lam):
    adv, next_v, next_a = [0.0] * len(rewards), 0.0, 0.0
    for t in reversed(range(len(rewards))):
        delta = rewards[t] + gamma * next_v - values[t]
        next_a = delta + gamma * lam * next_a
        adv[t], next_v = next_a, values[t]
    return adv


def _trajectories(n, seed):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(9) for _ in range(2)]
        k = rng.randint(1, 4)
        out.append(Trajectory(prompt + [rng.randrange(9) for _ in range(k)], 2, [(2, 2 + k)], [0.0] * k, [0] * k,
                              rng.random(), group_id=str(i // 2)))  # fmt: skip
    return out


def test_gae_advantages_are_whitened_over_the_batch_by_default():
    exp = make_experience(_trajectories(6, 0), max_len=8)
    g = torch.Generator().manual_seed(0)
    exp.values = torch.where(exp.action_mask, torch.randn(exp.action_mask.shape, generator=g), 0.0)
    cfg = AlgorithmConfig(advantage="gae", gamma=0.9, lam=0.8)
    assert cfg.whiten and not AlgorithmConfig().whiten
    compute_advantages(exp, cfg)
    raw = []
    for b in range(exp.num_samples):
        cols = exp.action_mask[b].nonzero().flatten().tolist()
        rewards = [0.0] * (len(cols) - 1) + [float(exp.reward[b])]
        raw += _gae_loop(rewards, [float(exp.values[b, c]) for c in cols], 0.9, 0.8)
    mean = sum(raw) / len(raw)
    std = math.sqrt(sum((x - mean) ** 2 for x in raw) / (len(raw) - 1))
    assert exp.advantages[exp.action_mask].tolist() == pytest.approx([(x - mean) / (std + 1e-6) for x in raw], abs=1e-5)
    raw_cfg = AlgorithmConfig(advantage="gae", gamma=0.9, lam=0.8, whiten_advantages=False)
    assert compute_advantages(exp, raw_cfg).advantages[exp.action_mask].tolist() == pytest.approx(raw, abs=1e-5)
    assert (exp.advantages[~exp.action_mask] == 0).all()
    a, _ = gae(torch.zeros(1, 3), torch.zeros(1, 3), torch.zeros(1, 3, dtype=torch.long), exp.action_mask[:1, :3], 1,
               1.0, 1.0)  # fmt: skip
    assert (whiten(a, torch.zeros(1, 3, dtype=torch.bool)) == 0).all()


def test_reinforce_pp_baseline():
    # REINFORCE++-baseline: r - group mean on the last token, discounted returns, whitened over the batch
    exp = make_experience(_trajectories(6, 1), max_len=8)
    compute_advantages(exp, AlgorithmConfig(advantage="reinforce_pp_baseline", gamma=0.7))
    raw = []
    for b in range(exp.num_samples):
        group = [i for i in range(exp.num_samples) if exp.group_index[i] == exp.group_index[b]]
        r = float(exp.reward[b]) - sum(float(exp.reward[i]) for i in group) / len(group)
        k = int(exp.action_mask[b].sum())
        raw += [r * 0.7 ** (k - 1 - t) for t in range(k)]
    mean = sum(raw) / len(raw)
    std = math.sqrt(sum((x - mean) ** 2 for x in raw) / (len(raw) - 1))
    assert exp.advantages[exp.action_mask].tolist() == pytest.approx([(x - mean) / (std + 1e-6) for x in raw], abs=1e-5)


def test_adaptive_kl_controller():
    # Ziegler et al. 2019: e = clip(KL / target - 1, -0.2, 0.2); beta *= 1 + e · n / horizon
    assert adaptive_kl_coef(0.1, 0.15, 0.1, 1000, 64) == pytest.approx(0.1 * (1 + 0.2 * 64 / 1000))
    assert adaptive_kl_coef(0.1, 0.09, 0.1, 1000, 64) == pytest.approx(0.1 * (1 - 0.1 * 64 / 1000))
    assert adaptive_kl_coef(0.1, 0.0, 0.1, 1000, 64) == pytest.approx(0.1 * (1 - 0.2 * 64 / 1000))
    with pytest.raises(ValueError, match="kl_coef > 0"):
        AlgorithmConfig(kl_target=0.1)


def test_abs_and_mse_kl_estimators():
    logp, ref = torch.tensor([-1.0, -2.0], dtype=torch.float64), torch.tensor([-1.5, -1.0], dtype=torch.float64)
    assert kl_estimate(logp, ref, "abs").tolist() == pytest.approx([0.5, 1.0])
    assert kl_estimate(logp, ref, "mse").tolist() == pytest.approx([0.125, 0.5])
