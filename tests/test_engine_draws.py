"""The engine's random draws: splitmix64 bits per token, the inverse-CDF sample, and seeded requests that
draw the same tokens whatever batch they share (so the whole batch samples in one pass, or one graph).

Expected values come from the reference splitmix64 stream, from counting the grid of uniforms that falls
in each token's share of the distribution, and from the same request run alone.
"""

import random
from concurrent.futures import Future

import torch

from molt_hpc.engine.batch import Row, plain_rows, sample_rows
from molt_hpc.engine.sampling import GOLDEN, MASK64, SamplingParams, inverse_cdf, mix64, seeded_bits
from molt_hpc.engine.scheduler import Scheduler
from molt_hpc.engine.slots import SlotRunner
from molt_hpc.models import load_causal_lm


def test_mix64_gives_the_reference_splitmix64_stream() -> None:
    # splitmix64 seeded with 1234567: the first five outputs of its reference implementation
    want = [6457827717110365317, 3203168211198807973, 9817491932198370423, 4593380528125082431, 16408922859458223821]
    assert [mix64((1234567 + k * GOLDEN) & MASK64) for k in range(1, 6)] == want


def test_seeded_bits_depend_on_the_seed_and_the_index_alone() -> None:
    assert seeded_bits(7, 3) == seeded_bits(7, 3)
    assert seeded_bits(7, 3) == mix64((mix64(7) + 4 * GOLDEN) & MASK64) >> 32
    assert len({seeded_bits(7, i) for i in range(1000)}) == 1000, "every token of an answer draws anew"
    assert seeded_bits(7, 0) != seeded_bits(8, 0) and seeded_bits(-1, 0) == seeded_bits(MASK64, 0)
    values = torch.tensor([seeded_bits(s, i) for s in range(100) for i in range(100)], dtype=torch.float64)
    assert values.min() >= 0 and values.max() < 2**32
    u = values / 2**32
    # 10,000 uniforms: mean 0.5 and each tenth 1,000 strong, within 5 standard errors
    assert abs(u.mean().item() - 0.5) < 5 * (1 / 12 / len(u)) ** 0.5
    counts = torch.bincount((u * 10).long(), minlength=10).double()
    assert ((counts - 1000).abs() < 5 * (1000 * 0.9) ** 0.5).all(), counts


def test_inverse_cdf_gives_each_token_its_share_of_the_uniforms_and_none_to_filtered_ones() -> None:
    p = torch.tensor([0.1, 0.0, 0.25, 0.05, 0.0, 0.6])
    logp = p.log().expand(2, 6).contiguous()  # log 0 = -inf: a filtered-out token
    n = 4000
    grid = torch.arange(n, dtype=torch.int64) * (2**32 // n)  # n evenly spaced uniforms
    tokens = torch.cat([inverse_cdf(logp, grid[i : i + 2]) for i in range(0, n, 2)])
    share = torch.bincount(tokens, minlength=6).double() / n
    assert share[1] == 0 and share[4] == 0
    assert torch.allclose(share, p.double(), atol=1.0 / n + 1e-9), share


def test_a_seeded_row_draws_the_same_token_alone_and_anywhere_in_a_batch() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=gen) * 3

    def rows(seeds):
        return [Row([1, 2], SamplingParams(max_tokens=4, seed=s), Future()) for s in seeds]

    alone = rows([11])
    sample_rows(alone, logits[2:3], [r.bits(random.Random(0)) for r in alone])
    for order, rng_seed in (([5, None, 11, 3, None, 9], 1), ([11, 5, None, 3, 9, None], 2)):
        batch = rows(order)
        at = order.index(11)
        mixed = torch.cat([logits[:at], logits[2:3], logits[at:5]])  # the seeded row's logits at its place
        sample_rows(batch, mixed, [r.bits(random.Random(rng_seed)) for r in batch])
        assert batch[at].tokens == alone[0].tokens and batch[at].logprobs == alone[0].logprobs
    assert plain_rows(alone), "a seeded row samples plainly (in the decode graph on a GPU)"


def test_a_seeded_request_answers_the_same_alone_and_beside_others(tiny_model_dir) -> None:
    model = load_causal_lm(tiny_model_dir)

    def answers(prompts_and_seeds):
        runner = SlotRunner(model, torch.device("cpu"), max_batch=8, max_model_len=128)
        sched = Scheduler(runner, eos_ids=set(), max_batch=8, max_model_len=128, seed=0)
        rows = [Row(p, SamplingParams(max_tokens=12, ignore_eos=True, seed=s), Future()) for p, s in prompts_and_seeds]
        for row in rows:
            sched.submit(row)
        sched.drain()
        return [r.tokens for r in rows]

    target = ([5, 9, 14, 3], 2024)
    [alone] = answers([target])
    crowd = answers([([7, 8], None), ([4] * 9, 1), target, ([6, 6, 6], None), ([30, 31, 32, 33, 34], 2024)])
    assert crowd[2] == alone, "the same seed and prompt draw the same answer in any company"
    assert crowd[4] != alone, "the same seed over another prompt is another answer"
