"""Global aggregation on a real 2-process gloo group: 2 ranks x part of the batch == 1 rank x all of it.

Each rank takes an unequal share of the rows (different action-token and sample counts), cuts it into
micro-batches, divides every loss by the global `LossScale` (`global_loss_scale`, an all_reduce),
accumulates gradients, and the ranks' gradients are summed, as a data-parallel reduction with a divide
factor of 1 does. Every `loss_agg` mode, packed rows and padded rows, IS masking of whole samples; the
reference is one process over the whole batch in one micro-batch, float64.
"""

import random

import pytest
import torch
import torch.distributed as dist

from molt_hpc.algorithm.advantage import compute_advantages
from molt_hpc.algorithm.experience import make_experience
from molt_hpc.algorithm.logprobs import token_logprobs
from molt_hpc.algorithm.loss import global_loss_scale, policy_loss, policy_mask, value_loss
from molt_hpc.config.train import AlgorithmConfig
from molt_hpc.trajectory import Trajectory
from tests.ranks import spawn_ranks

H, V = 8, 13
RANK_ROWS = {True: ([0, 1], [2, 3, 4, 5, 6]), False: ([0, 1, 2], [3, 4, 5, 6, 7, 8, 9])}  # packed / padded rows
CASES = {
    "ppo": AlgorithmConfig(dual_clip=3.0, is_correction="truncate", is_threshold=1.2, kl_coef=0.1, entropy_coef=0.01),
    "gspo": AlgorithmConfig(
        policy_loss="gspo", eps_low=0.01, eps_high=0.01, is_correction="mask", is_level="sequence", is_threshold=1.1
    ),
    "cispo": AlgorithmConfig(policy_loss="cispo", advantage="rloo", loss_agg="seq-mean-token-sum"),
    "dr_grpo": AlgorithmConfig(advantage="dr_grpo", loss_agg="seq-mean-token-sum-norm", loss_agg_length=7),
    "gae": AlgorithmConfig(advantage="gae", loss_agg="seq-mean-token-mean", is_correction="mask", is_threshold=1.3),
}


def make_batch(pack: bool = True):
    """The same batch on every process: packed multi-turn samples, hidden states, rollout log-probs."""
    rng = random.Random(0)
    trajs = []
    for i in range(10):
        tokens, ranges = [rng.randrange(V) for _ in range(rng.randint(1, 3))], []
        for turn in range(rng.randint(1, 3)):
            if turn:
                tokens += [rng.randrange(V) for _ in range(2)]
            start = len(tokens)
            tokens += [rng.randrange(V) for _ in range(rng.randint(1, 5))]
            ranges.append((start, len(tokens)))
        n = sum(e - s for s, e in ranges)
        trajs.append(Trajectory(tokens, ranges[0][0], ranges, [0.0] * n, [0] * n, rng.random(), group_id=str(i // 5)))
    exp = make_experience(trajs, max_len=16, pack=pack)
    assert exp.sequences.shape[0] == (7 if pack else 10), "the row split below assumes 7 packed rows"
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(*exp.sequences.shape, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64) * 0.5
    value_head = torch.randn(H, generator=g, dtype=torch.float64)
    with torch.no_grad():
        logp, _ = token_logprobs(hidden, exp.sequences, lm_head_weight=weight, mask=exp.action_mask)
    noise = torch.randn(exp.sequences.shape, generator=g, dtype=torch.float64)
    exp.action_log_probs = torch.where(exp.action_mask, logp + 0.3 * noise, 0.0)
    exp.base_log_probs = torch.where(exp.action_mask, logp - 0.2 * noise.flip(0), 0.0)
    exp.values = torch.where(exp.action_mask, hidden @ value_head + 0.1, 0.0)
    exp.old_log_probs = torch.where(exp.action_mask, logp + 0.15 * torch.randn(logp.shape, generator=g), 0.0)
    return exp, hidden, weight, value_head


def gradients(cfg: AlgorithmConfig, rows: list[int], micro_rows: int, pack: bool = True):
    """(d loss / d head weight, d loss / d value head, loss scale) over `rows`, in micro-batches."""
    exp, hidden, weight, value_head = make_batch(pack)
    compute_advantages(exp, cfg)
    weight.requires_grad_(True)
    value_head.requires_grad_(True)
    micro = [rows[i : i + micro_rows] for i in range(0, len(rows), micro_rows)]
    parts = [exp.rows(torch.tensor(idx)) for idx in micro]
    masks = [policy_mask(p.action_mask, p.action_log_probs, cfg, old_log_probs=p.old_log_probs, seq_index=p.seq_index,
                         n_samples=exp.num_samples) for p in parts]  # fmt: skip
    scale = global_loss_scale(masks, [p.seq_index for p in parts], cfg.loss_agg_length or 0)
    value_scale = global_loss_scale([p.action_mask for p in parts], [p.seq_index for p in parts])
    for idx in micro:
        part, h = exp.rows(torch.tensor(idx)), hidden[idx]
        logp, ent = token_logprobs(
            h, part.sequences, lm_head_weight=weight, temperature=0.8, chunk=5, mask=part.action_mask
        )
        loss, _ = policy_loss(
            logp,
            part.action_log_probs,
            part.advantages,
            part.action_mask,
            cfg,
            scale,
            seq_index=part.seq_index,
            n_samples=exp.num_samples,
            base_log_probs=part.base_log_probs,
            entropy=ent,
            old_log_probs=part.old_log_probs if cfg.is_correction != "none" else None,
        )
        v_loss, _ = value_loss(h @ value_head, part.values, part.returns, part.action_mask, value_scale.tokens,
                               cfg.value_clip)  # fmt: skip
        (loss + cfg.value_coef * v_loss).backward()
    return weight.grad, value_head.grad, scale


def _rank_main(rank: int, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    results = {}
    for pack in (True, False):
        for name, cfg in CASES.items():
            rows = RANK_ROWS[pack][rank]
            gw, gv, scale = gradients(cfg, rows, micro_rows=2, pack=pack)
            local = int(make_batch(pack)[0].action_mask[rows].sum())
            for grad in (gw, gv):
                dist.all_reduce(grad, op=dist.ReduceOp.SUM)
            results[name, pack] = (gw, gv, scale, local)
    if rank == 0:
        torch.save(results, out)
    dist.destroy_process_group()


@pytest.mark.timeout(180)
def test_two_ranks_with_unequal_tokens_match_one_rank(tmp_path):
    out = tmp_path / "ranks.pt"
    spawn_ranks(_rank_main, (str(tmp_path / "store"), str(out)), 2)
    ranks = torch.load(out, weights_only=False)
    masked = 0
    for pack in (True, False):
        all_rows = RANK_ROWS[pack][0] + RANK_ROWS[pack][1]
        for name, cfg in CASES.items():
            gw, gv, scale, rank0_tokens = ranks[name, pack]
            ref_w, ref_v, ref_scale = gradients(cfg, all_rows, micro_rows=len(all_rows), pack=pack)
            assert scale == ref_scale and rank0_tokens * 2 != ref_scale.tokens  # global counts, unequal shares
            assert ref_w.abs().max() > 1e-3 and ref_v.abs().max() > 1e-3  # a real gradient, not zeros
            assert torch.allclose(gw, ref_w, atol=1e-6, rtol=0), (name, pack, (gw - ref_w).abs().max())
            assert torch.allclose(gv, ref_v, atol=1e-6, rtol=0), (name, pack, (gv - ref_v).abs().max())
            masked += ref_scale.samples < 10
    assert masked >= 2  # the IS mask dropped whole samples from the counts in some cases
