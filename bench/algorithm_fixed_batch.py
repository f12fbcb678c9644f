"""The policy loss, per-token weights and advantages of the default configs on one fixed, seeded batch.

Prints what each default does to the same numbers, so two versions of `molt_hpc.algorithm` can be
compared side by side: run it from a checkout (`python bench/algorithm_fixed_batch.py`), or against
another one with `PYTHONPATH=<other checkout> python bench/algorithm_fixed_batch.py`. Sections:

1. CISPO and GSPO with the default IS settings: the loss and each token's effective weight
   (`d loss / d logp` over `-A / tokens`: CISPO's is `min(r, 1 + eps_high)` in its paper);
2. GAE advantages with the defaults: their mean and std over action tokens, and the PPO loss with them;
3. GSPO's loss with the default aggregation, on samples of unequal lengths.
"""

import torch

from molt_hpc.algorithm import compute_advantages, make_experience, policy_loss
from molt_hpc.algorithm import loss as loss_module
from molt_hpc.config.train import AlgorithmConfig
from molt_hpc.trajectory import Trajectory

NEW_API = hasattr(loss_module, "LossScale")
LENGTHS = [3, 12, 5, 20]


def batch():
    """4 samples, one per padded row, of 3/12/5/20 action tokens; engine log-probs 0.6 nats off on average."""
    g = torch.Generator().manual_seed(0)
    t = max(LENGTHS)
    mask = torch.tensor([[c < n for c in range(t)] for n in LENGTHS])
    logp = -torch.rand(len(LENGTHS), t, generator=g, dtype=torch.float64) * 2
    engine = logp + torch.randn(logp.shape, generator=g, dtype=torch.float64) * 0.6
    adv = torch.tensor([1.0, -0.5, 0.8, -1.2], dtype=torch.float64)[:, None].expand(-1, t).clone()
    return mask, logp, engine, adv


def scale(mask):
    if NEW_API:
        return loss_module.LossScale(int(mask.sum()), len(LENGTHS), max(LENGTHS))
    return int(mask.sum())


def run(cfg, old=None):
    mask, logp, engine, adv = batch()
    x = logp.clone().requires_grad_(True)
    kw = {"old_log_probs": old} if old is not None else {}
    loss, _ = policy_loss(x, engine, adv, mask, cfg, scale(mask), **kw)
    loss.backward()
    weights = x.grad / (-adv / int(mask.sum()))
    return loss.item(), weights, mask, torch.exp(logp - engine)


def section_1():
    print("1. default IS settings (is_correction default:", AlgorithmConfig().is_correction + ")")
    loss, w, mask, r = run(AlgorithmConfig(policy_loss="cispo"))
    print(f"  CISPO loss {loss:.6f}")
    print("  CISPO tokens with r > 2: r -> effective weight (paper: min(r, 1.28) = 1.28)")
    for b, c in (mask & (r > 2)).nonzero().tolist():
        print(f"    r = {r[b, c].item():.3f} -> {w[b, c].item():.4f}")
    gspo = {"is_level": "sequence"} if NEW_API else {}
    loss, w, mask, _ = run(AlgorithmConfig(policy_loss="gspo", eps_low=3e-4, eps_high=4e-4, **gspo))
    print(f"  GSPO (eps 3e-4/4e-4) loss {loss:.6f}")
    if NEW_API:
        old = batch()[1] + 0.1 * torch.randn(batch()[1].shape, generator=torch.Generator().manual_seed(1))
        cfg = AlgorithmConfig(policy_loss="cispo", is_correction="truncate")
        loss, w, mask, _ = run(cfg, old=old)
        print(f"  CISPO + truncated IS against a recomputed old policy (old = logp + 0.1 noise): loss {loss:.6f}")


def trajectories():
    g = torch.Generator().manual_seed(2)
    out = []
    for i, n in enumerate([4, 9, 2, 7, 5, 11]):
        tokens = torch.randint(1, 50, (3 + n,), generator=g).tolist()
        reward = float(torch.rand((), generator=g))
        out.append(Trajectory(tokens, 3, [(3, 3 + n)], [0.0] * n, [0] * n, reward, group_id=str(i // 2)))
    return out


def section_2():
    exp = make_experience(trajectories(), max_len=16)
    g = torch.Generator().manual_seed(3)
    exp.values = torch.where(exp.action_mask, torch.rand(exp.action_mask.shape, generator=g), 0.0)
    if NEW_API:  # the same run's raw advantages, what the previous version returned
        raw = compute_advantages(exp, AlgorithmConfig(advantage="gae", whiten_advantages=False)).advantages
        print(f"2. GAE advantages, whiten_advantages = false: mean {raw[exp.action_mask].double().mean().item():.6f}")
    compute_advantages(exp, AlgorithmConfig(advantage="gae"))
    a = exp.advantages[exp.action_mask].double()
    print(f"2. GAE advantages (defaults): mean {a.mean().item():.6f}, std {a.std().item():.6f}, "
          f"min {a.min().item():.4f}, max {a.max().item():.4f}")  # fmt: skip
    noise = torch.randn(exp.action_mask.shape, generator=g, dtype=torch.float64)
    logp = exp.action_log_probs.double() + 0.1 * noise
    x = logp.clone().requires_grad_(True)
    loss, _ = policy_loss(x, exp.action_log_probs.double(), exp.advantages.double(), exp.action_mask,
                          AlgorithmConfig(advantage="gae"), exp.num_action_tokens)  # fmt: skip
    print(f"  PPO loss with them: {loss.item():.6f}")


def section_3():
    cfg = AlgorithmConfig(policy_loss="gspo", eps_low=3e-4, eps_high=4e-4, is_correction="none")
    agg = cfg.aggregation if NEW_API else "token-mean (fixed)"
    loss, *_ = run(cfg)
    mask, _, _, adv = batch()
    print(f"3. GSPO aggregation {agg}: loss {loss:.6f}")
    if NEW_API:  # the same run's token mean, the previous fixed mode
        print(
            f"  GSPO with loss_agg = 'token-mean': loss {run(cfg.model_copy(update={'loss_agg': 'token-mean'}))[0]:.6f}"
        )
    by_tokens = [round(n / int(mask.sum()), 4) for n in LENGTHS]
    print(
        f"  each sample's weight: {by_tokens} by token-mean, 0.25 each by seq-mean-token-mean; A = {adv[:, 0].tolist()}"
    )


if __name__ == "__main__":
    print("API:", "LossScale (loss_agg)" if NEW_API else "token count only")
    section_1()
    section_2()
    section_3()
