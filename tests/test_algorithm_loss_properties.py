"""Property tests of the policy loss: masked tokens are inert, ratio 1 gives -mean(A), clip bounds hold."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from molt_hpc.algorithm.loss import POLICY_LOSSES, LossScale, policy_loss, ppo_loss, value_loss
from molt_hpc.algorithm.segments import row_seq_index
from molt_hpc.config.train import AlgorithmConfig

shapes = st.tuples(st.integers(1, 4), st.integers(2, 12))
seeds = st.integers(0, 2**31 - 1)
settings_ = st.fixed_dictionaries(
    {
        "policy_loss": st.sampled_from(list(POLICY_LOSSES)),
        "is_correction": st.sampled_from(["none", "truncate", "mask"]),
        "is_level": st.sampled_from(["token", "sequence"]),
        "is_threshold": st.floats(1.1, 4.0),
        "eps_low": st.floats(0.05, 0.5),
        "eps_high": st.floats(0.05, 0.5),
        "dual_clip": st.one_of(st.none(), st.floats(1.5, 5.0)),
        "kl_coef": st.sampled_from([0.0, 0.1]),
        "kl_estimator": st.sampled_from(["k1", "k2", "k3", "abs", "mse"]),
        "entropy_coef": st.sampled_from([0.0, 0.01]),
        "loss_agg": st.sampled_from(
            [None, "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
        ),
    }
)


def _config(kw: dict) -> AlgorithmConfig:
    if kw["policy_loss"] == "gspo" and kw["is_correction"] != "none":
        kw = {**kw, "is_level": "sequence"}  # the config refuses a per-token factor on GSPO's per-sample ratio
    return AlgorithmConfig(**kw)


configs = settings_.map(_config)


def batch(shape, seed):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(shape, generator=g) < 0.6
    mask[0, -1] = True  # at least one action token
    logp = -torch.rand(shape, generator=g, dtype=torch.float64) * 3
    rollout = logp + torch.randn(shape, generator=g, dtype=torch.float64) * 0.4
    adv = torch.randn(shape, generator=g, dtype=torch.float64)
    base = logp + torch.randn(shape, generator=g, dtype=torch.float64) * 0.3
    ent = torch.rand(shape, generator=g, dtype=torch.float64) * 2
    old = logp + torch.randn(shape, generator=g, dtype=torch.float64) * 0.3
    return mask, logp, rollout, adv, base, ent, old


def loss_and_grad(cfg, mask, logp, rollout, adv, base, ent, old, count):
    x = logp.clone().requires_grad_(True)
    # other micro-batches' tokens and samples count too
    scale = LossScale(count, int(mask.any(dim=1).sum()) + 2, 9)
    old = old if cfg.is_correction != "none" else None
    loss, _ = policy_loss(x, rollout, adv, mask, cfg, scale, base_log_probs=base, entropy=ent, old_log_probs=old)
    loss.backward()
    return loss.detach(), x.grad


@settings(max_examples=60, deadline=None)
@given(cfg=configs, shape=shapes, seed=seeds, junk=st.sampled_from([0.0, -1e6, 1e6, 37.0, float("nan")]))
def test_masked_tokens_never_change_loss_or_gradient(cfg, shape, seed, junk):
    mask, *tensors = batch(shape, seed)
    count = int(mask.sum()) + 3  # other micro-batches' tokens count too
    loss, grad = loss_and_grad(cfg, mask, *tensors, count)
    scrambled = [torch.where(mask, t, torch.full_like(t, junk)) for t in tensors]
    loss2, grad2 = loss_and_grad(cfg, mask, *scrambled, count)
    assert torch.isfinite(loss2) and torch.equal(loss, loss2)
    assert torch.equal(grad, grad2)
    assert (grad[~mask] == 0).all()


@settings(max_examples=40, deadline=None)
@given(cfg=configs, shape=shapes, seed=seeds)
def test_ratio_one_gives_minus_mean_advantage(cfg, shape, seed):
    cfg = cfg.model_copy(update={"kl_coef": 0.0, "entropy_coef": 0.0, "loss_agg": "token-mean"})
    mask, logp, _, adv, _, _, _ = batch(shape, seed)
    n = int(mask.sum())
    x = logp.clone().requires_grad_(True)
    loss, m = policy_loss(x, logp, adv, mask, cfg, n)
    loss.backward()
    expected = -adv[mask].sum().item() / n
    if cfg.policy_loss == "cispo":  # its surrogate is A·log r, 0 at r = 1; the gradient is the same
        expected = 0.0
    assert loss.item() == pytest.approx(expected, abs=1e-9)
    # on-policy, every variant is the policy gradient -A·∇logp / n
    assert torch.allclose(x.grad, torch.where(mask, -adv / n, torch.zeros_like(adv)), atol=1e-12)
    assert m["ratio_mean"].item() == pytest.approx(1.0) and m["clip_frac"].item() == 0.0


@settings(max_examples=60, deadline=None)
@given(shape=shapes, seed=seeds, eps=st.tuples(st.floats(0.05, 0.5), st.floats(0.05, 0.5)), c=st.floats(1.5, 5.0))
def test_per_token_objective_never_exceeds_the_clipped_bound(shape, seed, eps, c):
    mask, logp, rollout, adv, _, _, _ = batch(shape, seed)
    log_ratio = torch.where(mask, logp - rollout, torch.zeros_like(logp)) * 3
    ratio = log_ratio.exp()
    for dual in (None, c):
        cfg = AlgorithmConfig(eps_low=eps[0], eps_high=eps[1], dual_clip=dual)
        tok_loss, _ = ppo_loss(log_ratio, adv, mask, row_seq_index(mask), shape[0], cfg)
        objective = -tok_loss
        tol = 1e-12
        assert (objective <= ratio.clamp(1 - eps[0], 1 + eps[1]) * adv + tol).all()
        assert (objective <= (1 + eps[1]) * adv.clamp(min=0) + tol).all()
        if dual is None:  # the pessimistic bound: never above the unclipped surrogate either
            assert (objective <= ratio * adv + tol).all()
        else:  # dual-clip lifts it only to c·A: a negative advantage never costs more than c·|A|
            assert (tok_loss <= c * adv.abs() + tol).all()


@settings(max_examples=30, deadline=None)
@given(shape=shapes, seed=seeds, junk=st.sampled_from([-1e6, 1e6, float("nan")]))
def test_value_loss_masked_tokens_are_inert(shape, seed, junk):
    mask, v, old, ret, _, _, _ = batch(shape, seed)

    def run(v, old, ret):
        x = v.clone().requires_grad_(True)
        loss, _ = value_loss(x, old, ret, mask, int(mask.sum()), clip=0.2)
        loss.backward()
        return loss.detach(), x.grad

    a = run(v, old, ret)
    b = run(*(torch.where(mask, t, torch.full_like(t, junk)) for t in (v, old, ret)))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
