"""The builtin engine's fast decode parts: fused projections, sampling inside the decode graph.

On the CPU: a fused model computes the logits of the unfused one, keeps its parameter names, and takes
in-place weight writes (a refit) into the fused tensors; `plain_sample` draws from the distribution
`processed_logprobs` defines and returns its log-probs. On a GPU (marked gpu): the scheduler over a
slot runner with fused projections and sampling graphs generates tokens whose log-probs equal a
teacher-forced recompute of the same sequences.
"""

import copy
from concurrent.futures import Future

import pytest
import torch

from molt_hpc.engine.fuse import FusedLinear, fuse_projections
from molt_hpc.engine.graphs import plain_sample
from molt_hpc.engine.sampling import processed_logprobs
from molt_hpc.models import load_causal_lm


def test_fused_projections_compute_the_plain_model(tiny_model_dir) -> None:
    plain = load_causal_lm(tiny_model_dir)
    fused = copy.deepcopy(plain)
    names = list(plain.state_dict())
    assert fuse_projections(fused) == 2 * plain.config.num_hidden_layers
    assert list(fused.state_dict()) == names, "parameter names (what refits and checkpoints use) changed"
    assert sum(isinstance(m, FusedLinear) for m in fused.modules()) == 5 * plain.config.num_hidden_layers
    ids = torch.randint(4, 100, (3, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(fused(ids).logits, plain(ids).logits, atol=1e-5)
        # a refit writes each named parameter in place: the fused tensors must see it
        gen = torch.Generator().manual_seed(1)
        live = fused.state_dict(keep_vars=True)
        for name, p in plain.state_dict(keep_vars=True).items():
            new = p + torch.randn(p.shape, generator=gen) * 0.05
            p.copy_(new)
            live[name].copy_(new)
        assert torch.allclose(fused(ids).logits, plain(ids).logits, atol=1e-5)


def test_plain_sample_draws_from_the_processed_distribution() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 6, generator=gen) * 2
    temps = torch.tensor([0.7, 1.0, 0.0])
    want = processed_logprobs(logits, temps, torch.zeros(3, dtype=torch.long), torch.ones(3), torch.zeros(3))
    draws = 20000
    rep = logits.repeat_interleave(draws, 0)
    bits = torch.randint(0, 2**32, (3 * draws,), generator=torch.Generator().manual_seed(5))
    out = plain_sample(rep, temps.repeat_interleave(draws), bits)
    tokens, logp = out[0].long().view(3, draws), out[1].view(3, draws)
    assert torch.allclose(logp, want.double().gather(1, tokens), atol=1e-6), "the log-prob of the drawn token"
    assert torch.equal(tokens[2], torch.full((draws,), int(logits[2].argmax()))), "temperature 0 is greedy"
    for r in range(2):
        freq = torch.bincount(tokens[r], minlength=6).double() / draws
        p = want[r].double().exp()
        # 5 standard errors of a binomial frequency: a wrong distribution misses by far more
        assert ((freq - p).abs() <= 5 * (p * (1 - p) / draws).sqrt() + 1e-9).all(), (freq, p)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_graph_sampling_logprobs_equal_a_teacher_forced_recompute(tiny_model_dir) -> None:
    from molt_hpc.algorithm import token_logprobs
    from molt_hpc.engine.batch import Row
    from molt_hpc.engine.sampling import SamplingParams
    from molt_hpc.engine.scheduler import Scheduler
    from molt_hpc.engine.slots import SlotRunner

    device = torch.device("cuda")
    model = load_causal_lm(tiny_model_dir, device="cuda")
    teacher = copy.deepcopy(model)
    runner = SlotRunner(model, device, max_batch=8, max_model_len=256, graphs=True, sampling=True, fuse=True)
    sched = Scheduler(runner, eos_ids=set(), max_batch=8, max_model_len=256, seed=0)
    gen = torch.Generator().manual_seed(0)
    temps = [1.0, 0.7, 0.0, 1.0, 1.3]
    seeds = [None, 7, None, 8, None]  # seeded rows sample inside the graph too
    rows = [Row(torch.randint(4, 100, (n,), generator=gen).tolist(),
                SamplingParams(max_tokens=40, ignore_eos=True, temperature=t, seed=s), Future())
            for n, t, s in zip([5, 9, 3, 17, 11], temps, seeds, strict=True)]  # fmt: skip
    for row in rows:
        sched.submit(row)
    while sched.rows or sched.waiting:
        sched._step()
    assert runner.graphs is not None and runner.graphs.sampled, "no decode step sampled inside a graph"
    for row, t in zip(rows, temps, strict=True):
        ids = torch.tensor([row.prompt + row.tokens], device=device)
        with torch.no_grad():
            logp, _ = token_logprobs(teacher(ids).logits, ids, temperature=t if t > 0 else 1.0)
        want = logp[0, len(row.prompt) :].double().cpu()
        assert torch.allclose(torch.tensor(row.logprobs, dtype=torch.float64), want, atol=2e-3), (t, row.logprobs)
