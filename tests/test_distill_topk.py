"""`distill.top_k`: the teacher's top tokens per action token through the trace (buffer codec, truncation,
padded and packed rows), the student's log-probs of given tokens (`gathered_logprobs`, values and gradients),
and the trainer's per-token top-k forward KL from one forward, padded and packed, each against a float64
computation written here from a plain transformers forward.
"""

import copy
import dataclasses
import math
import random

import pytest
import torch

from molt_hpc.actor.batch import policy_logprobs
from molt_hpc.actor.packing import packed
from molt_hpc.algorithm.distill import gathered_logprobs
from molt_hpc.algorithm.experience import make_experience
from molt_hpc.buffer.codec import decode_group, encode_group
from molt_hpc.parallel.attention import DocumentAttention, use_document_attention
from molt_hpc.trajectory import Group, Trajectory
from tests.test_actor_cp import CPU, V, groups, tiny_model

K = 3


def with_top(traj: Trajectory, seed: int) -> Trajectory:
    """`traj` with teacher log-probs and K distinct top tokens (and their made-up log-probs) per action token."""
    rng = random.Random(seed)
    n = traj.num_action_tokens
    ids = [rng.sample(range(V), K) for _ in range(n)]
    top = [sorted((-rng.randint(1, 40) / 8 for _ in range(K)), reverse=True) for _ in range(n)]  # float32-exact
    return dataclasses.replace(traj, teacher_logprobs=[-1.0] * n, teacher_top_ids=ids, teacher_top_logprobs=top)


def taught_groups() -> list[Group]:
    out = groups()
    for g in out:
        g.samples = [with_top(s, 100 * i + len(s.tokens)) for i, s in enumerate(g.samples)]
    return out


def test_teacher_top_tokens_travel_through_buffer_and_batch() -> None:
    group = taught_groups()[0]
    samples = decode_group(encode_group(group)).samples
    for name in ("teacher_top_ids", "teacher_top_logprobs"):
        assert [getattr(s, name) for s in samples] == [getattr(s, name) for s in group.samples]
    for pack in (False, True):
        exp = make_experience(samples, max_len=64, pack=pack)
        assert exp.teacher_top_ids.shape[-1] == K
        for n, traj in enumerate(samples):
            row, cols = torch.nonzero(exp.seq_index == n, as_tuple=True)
            mask = exp.action_mask[row, cols]
            assert exp.teacher_top_ids[row, cols][mask].tolist() == traj.teacher_top_ids
            assert exp.teacher_top_log_probs[row, cols][mask].tolist() == traj.teacher_top_logprobs
            assert not exp.teacher_top_ids[row, cols][~mask].any()
    mb = packed(make_experience(samples, max_len=64), torch.arange(len(samples)))
    assert mb.batch.teacher_top_ids.shape == (1, sum(len(s.tokens) for s in samples), K)
    assert mb.batch.teacher_top_ids[mb.batch.action_mask].tolist() == [r for s in samples for r in s.teacher_top_ids]
    # truncation drops the top rows of the cut turn with its tokens
    long = max(samples, key=lambda s: len(s.action_ranges))
    cut = make_experience([long], max_len=long.action_ranges[-1][1] - 1)
    kept = sum(b - a for a, b in long.action_ranges[:-1])
    assert cut.teacher_top_ids[cut.action_mask].tolist() == long.teacher_top_ids[:kept]
    with pytest.raises(AssertionError, match="one row of teacher top tokens per action token"):
        dataclasses.replace(long, teacher_top_ids=long.teacher_top_ids[:-1],
                            teacher_top_logprobs=long.teacher_top_logprobs[:-1])  # fmt: skip


def test_gathered_logprobs_match_float64() -> None:
    """Values and gradients (hidden states and the head) against float64 log-softmax, 3 rows per chunk."""
    torch.manual_seed(1)
    hidden, weight = torch.randn(7, 16, requires_grad=True), torch.randn(V, 16, requires_grad=True)
    ids = torch.randint(0, V, (7, K))
    got = gathered_logprobs(hidden, weight, ids, 0.7, chunk=3)
    h64, w64 = hidden.detach().double().requires_grad_(True), weight.detach().double().requires_grad_(True)
    want = torch.log_softmax((h64 @ w64.t()) / 0.7, dim=-1).gather(-1, ids)
    assert got.dtype == torch.float32 and torch.allclose(got.double(), want, atol=1e-5)
    coef = torch.randn(7, K)
    (got * coef).sum().backward()
    (want * coef.double()).sum().backward()
    assert torch.allclose(hidden.grad.double(), h64.grad, atol=1e-4)
    assert torch.allclose(weight.grad.double(), w64.grad, atol=1e-4)
    logits = torch.randn(5, V)  # logits as the source (a model whose head is not a plain matmul)
    want = torch.log_softmax(logits.double(), dim=-1).gather(-1, ids[:5])
    assert torch.allclose(gathered_logprobs(logits, None, ids[:5], 1.0, 2).double(), want, atol=1e-6)


def reference_kl(model, traj: Trajectory, temperature: float) -> list[float]:
    """Per action token, sum_j q_j (log q_j - log p_s(j)) in float64 from a plain forward of the sample alone."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([traj.tokens])).logits[0].double()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    out, at = [], 0
    for a, b in traj.action_ranges:
        for t in range(a, b):
            top = traj.teacher_top_logprobs[at]
            z = sum(math.exp(x) for x in top)
            q = [math.exp(x) / z for x in top]
            out.append(sum(qj * (math.log(qj) - float(logp[t - 1, i]))
                           for qj, i in zip(q, traj.teacher_top_ids[at], strict=True)))  # fmt: skip
            at += 1
    return out


def test_policy_top_kl_padded_and_packed() -> None:
    """The trainer's top-k forward KL (one forward with the log-probs): padded rows on the plain model and
    packed rows on document attention give the float64 per-token values, and its gradient reaches the model."""
    samples = [s for g in taught_groups() for s in g.samples]
    plain = tiny_model()
    docs = copy.deepcopy(plain)
    use_document_attention(docs, DocumentAttention("sdpa", CPU))
    want = [x for s in samples for x in reference_kl(plain, s, 0.7)]
    for model, pack in ((plain, False), (docs, True)):
        exp = make_experience(samples, max_len=64, pack=pack)
        mb = packed(exp, torch.arange(exp.sequences.shape[0])) if pack else None
        batch = mb.batch if mb is not None else exp
        top: list[torch.Tensor] = []
        policy_logprobs(model, batch, 0.7, chunk=5, top_kl=top)
        (kl,) = top
        got = [float(x) for n in range(len(samples)) for x in kl.detach()[batch.action_mask & (batch.seq_index == n)]]
        assert got == pytest.approx(want, abs=1e-5)
        assert not kl[~batch.action_mask].any() and min(want) > 0
        model.zero_grad()
        kl.sum().backward()
        assert model.lm_head.weight.grad.abs().sum() > 0


def _cp_rank(rank: int, port: int, out: str) -> None:
    """Rank `rank` of a (dp 1, cp 2) grid: the whole batch as one micro-batch split over the CP group."""
    import os

    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))  # fmt: skip
    from molt_hpc.actor.packing import rank_micro_batches, sequence_layout
    from molt_hpc.actor.world import init_world
    from molt_hpc.config.train import ActorConfig
    from molt_hpc.parallel import parallelize
    from tests.test_actor_cp import config

    world = init_world(ActorConfig(device="cpu", cp=2))
    cfg = config("actor.cp=2", "rollout.temperature=0.7")
    model = tiny_model()
    docs, _ = sequence_layout(cfg, world, model)
    parallelize(model, world.mesh, cfg.actor, documents=docs)
    exp = make_experience([s for g in taught_groups() for s in g.samples], max_len=64)
    whole = rank_micro_batches(exp, torch.arange(exp.sequences.shape[0]), 99, None, world)[0]
    top: list[torch.Tensor] = []
    with torch.no_grad():
        policy_logprobs(model, whole.batch, 0.7, 7, top_kl=top)
    dist.destroy_process_group()
    if rank == 0:
        torch.save({"kl": top[0], "mask": whole.batch.action_mask, "seq": whole.batch.seq_index}, out)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_policy_top_kl_under_context_parallelism(tmp_path) -> None:
    """Two CP ranks hold halves of every row; the gathered top-k forward KL is the float64 one."""
    from molt_hpc.net import free_port
    from tests.ranks import spawn_ranks

    out = tmp_path / "cp.pt"
    spawn_ranks(_cp_rank, (free_port("127.0.0.1"), str(out)), 2)
    got = torch.load(out, weights_only=False)
    samples = [s for g in taught_groups() for s in g.samples]
    want = [x for s in samples for x in reference_kl(tiny_model(), s, 0.7)]
    kl, mask, seq = got["kl"], got["mask"], got["seq"]
    assert [float(x) for n in range(len(samples)) for x in kl[mask & (seq == n)]] == pytest.approx(want, abs=1e-5)
