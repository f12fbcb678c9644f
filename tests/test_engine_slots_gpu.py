"""The engine's GPU decode path: the preallocated slot cache (here on the CPU too) and CUDA-graph decode.

One scripted run drives several runners over one model through the same steps: rows that leave and
join (other batch buckets), contexts that grow past a width bucket, and weights replaced in place as a
refit does. Every step's logits must agree across runners and match a teacher-forced forward of each
context. On the CPU: the slot cache (eager) against the growing `DynamicCache` runner, and the step traced
by `torch.compile` against the eager one; on a GPU (`make test-gpu`): CUDA graphs, then graphs of the
inductor-compiled step, against the eager slot cache.
"""

import random

import pytest
import torch

from molt_hpc.engine.batch import ModelRunner
from molt_hpc.engine.slots import SlotRunner
from molt_hpc.models import load_causal_lm


def teacher(model, contexts: list[list[int]], device: str) -> torch.Tensor:
    with torch.no_grad():
        return torch.stack([model(torch.tensor([c], device=device)).logits[0, -1] for c in contexts])


def drive(model, runners: list, device: str, steps: int) -> float:
    """Run the script on every runner; returns the largest difference between runners' logits."""
    rng = random.Random(0)
    rows = [[rng.randrange(4, 104) for _ in range(n)] for n in (3, 40, 11)]
    batches = [r.join(None, r.prefill(rows)[1]) for r in runners]
    worst = 0.0
    for step in range(steps):
        rows = [[*r, rng.randrange(4, 104)] for r in rows]
        last, positions = [r[-1] for r in rows], [len(r) - 1 for r in rows]
        logits = [r.decode(b, last, positions) for r, b in zip(runners, batches, strict=True)]
        worst = max(worst, *(float((x - logits[0]).abs().max()) for x in logits[1:]))
        if step % 9 == 0 and step < steps * 3 // 4:  # (after the weight change the caches hold old K/V)
            assert float((logits[-1] - teacher(model, rows, device)).abs().max()) < 1e-4, step
        if step == steps // 4:  # a row leaves
            for batch in batches:
                batch.keep([1, 2], max(len(rows[1]), len(rows[2])))  # the columns the kept rows use
            rows = [rows[1], rows[2]]
        if step == steps // 2:  # two rows join
            new = [[rng.randrange(4, 104) for _ in range(n)] for n in (7, 2)]
            batches = [r.join(b, r.prefill(new)[1]) for r, b in zip(runners, batches, strict=True)]
            rows += new
        if step == steps * 3 // 4:  # a refit writes new weights into the same tensors
            gen = torch.Generator(device=device).manual_seed(1)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, generator=gen, device=device) * 0.02)
    return worst


def test_slot_cache_decodes_as_the_growing_cache(tiny_model_dir) -> None:
    model = load_causal_lm(tiny_model_dir)
    cpu = torch.device("cpu")
    runners = [ModelRunner(model, cpu), SlotRunner(model, cpu, max_batch=8, max_model_len=128)]
    assert drive(model, runners, "cpu", 40) < 1e-5


def test_compiled_step_is_one_dynamic_trace_that_decodes_as_the_eager_one(tiny_model_dir) -> None:
    """The trace, not the kernels: a backend that runs dynamo's graph as it is (inductor's kernels are the
    GPU test's). Every batch and width bucket of the script reuses the graph, except the step whose width
    reaches the cache's capacity (the attended view is then the whole cache: one more specialisation)."""
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    model = load_causal_lm(tiny_model_dir)
    cpu = torch.device("cpu")
    # fused projections too: their groups must hold no tensor between forwards, or the trace guards on it
    # (compiled first: it then runs right after the other runner's prefills)
    runners = [SlotRunner(model, cpu, max_batch=8, max_model_len=128, fuse=True, compile=counting),
               SlotRunner(model, cpu, max_batch=8, max_model_len=128)]  # fmt: skip
    assert drive(model, runners, "cpu", 80) < 1e-5  # batches of 3, 2 and 4 rows; widths past 64 up to 128
    assert 1 <= len(graphs) <= 2, f"{len(graphs)} traces: the compiled step recompiles per shape"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("flags", [{}, {"fuse": True, "compile": "inductor"}], ids=["graphs", "compiled-step graphs"])
def test_graph_decode_matches_eager_and_a_full_forward(tiny_model_dir, flags) -> None:
    model = load_causal_lm(tiny_model_dir, device="cuda")
    dev = torch.device("cuda")
    eager = SlotRunner(model, dev, max_batch=8, max_model_len=512)
    graphs = SlotRunner(model, dev, max_batch=8, max_model_len=512, graphs=True, **flags)
    assert drive(model, [eager, graphs], "cuda", 110) < 1e-4  # row 1 grows past 128 columns
    assert graphs.graphs is not None, "the capture failed and the runner fell back to eager decoding"
    captured = graphs.graphs.graphs
    assert {b for b, _ in captured} >= {2, 4} and {w for _, w in captured} >= {128, 256}
