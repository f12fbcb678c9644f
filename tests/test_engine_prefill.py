"""The slot prefill on the CPU (`engine/prefill.py`): right-padded rows written straight into the slot cache
give each context the K/V and next-token logits of a plain transformers forward over it alone, in exact
shapes and in the graphs' bucketed shapes (dummy rows, padding, length groups, several forwards), and a
scheduler on it keeps every sampled log-prob equal to a teacher-forced recompute."""

from concurrent.futures import Future

import pytest
import torch

from molt_hpc.engine import prefill as prefill_module
from molt_hpc.engine.batch import Row
from molt_hpc.engine.prefill import LENGTH_STEP, plan
from molt_hpc.engine.sampling import SamplingParams
from molt_hpc.engine.scheduler import Scheduler
from molt_hpc.engine.slots import SlotRunner
from molt_hpc.models import load_causal_lm
from tests.test_engine import teacher_forced


def test_plan_covers_every_row_once_in_bucketed_shapes(monkeypatch) -> None:
    monkeypatch.setattr(prefill_module, "PREFILL_TOKENS", 256)
    lengths = [5, 70, 33, 100, 64, 65, 3, 31, 90, 12] * 3
    for bucketed in (False, True):
        forwards = plan(lengths, bucketed, capacity=128, most_rows=32, replay=64)
        rows = [i for part, _, _ in forwards for i in part]
        assert sorted(rows) == list(range(len(lengths))), "every row in exactly one forward"
        for part, b, width in forwards:
            assert b >= len(part) and all(lengths[i] <= width for i in part)
            assert b * width <= 256 or b == 1, "a forward stays under PREFILL_TOKENS"
            if bucketed:
                assert width % LENGTH_STEP == 0 and b in (1, 2, 4, 8, 16, 24, 32)
            else:
                assert b == len(part) and width == max(lengths[i] for i in part)
    monkeypatch.setattr(prefill_module, "PREFILL_TOKENS", 8192)
    merged = plan([40, 70, 100], True, capacity=128, most_rows=32, replay=10**6)
    assert len(merged) == 1 and merged[0][2] == 128, "a dear forward merges the length buckets"
    apart = plan([40, 70, 100], True, capacity=128, most_rows=32, replay=1)
    assert [w for _, _, w in apart] == [64, 96, 128], "a cheap forward keeps them apart"


def check_prefill(model, runner, device: str, atol: float) -> None:
    """Prefill six contexts after two running rows; each must hold a plain forward's K/V and logits."""
    slots = runner.slots
    slots.kv.fill_(7.0)  # poison: what the prefill must not touch keeps it
    slots.rows = 2  # two rows already run in slots 0 and 1
    gen = torch.Generator().manual_seed(5)
    contexts = [torch.randint(4, 100, (n,), generator=gen).tolist() for n in (5, 17, 3, 40, 33, 9)]
    logits, part = runner.prefill(contexts, [None] * len(contexts))
    runner.join(slots, part)
    assert slots.rows == 8 and part.start == 2
    view = slots.kv.view(len(slots.kv), slots.slots + 1, slots.capacity, *slots.kv.shape[2:])
    assert (view[:, :2] == 7.0).all() and (view[:, 8:10] == 7.0).all(), "running rows and free slots untouched"
    layers = model.config.num_hidden_layers
    for i, ctx in enumerate(contexts):
        with torch.no_grad():
            out = model(torch.tensor([ctx], device=device), use_cache=True)
        torch.testing.assert_close(logits[i], out.logits[0, -1], atol=atol, rtol=atol)
        cache = out.past_key_values
        for layer in range(layers):
            keys, values = cache.layers[layer].keys[0], cache.layers[layer].values[0]  # [kv_heads, n, d]
            torch.testing.assert_close(view[layer, 2 + i, : len(ctx)], keys.transpose(0, 1), atol=atol, rtol=atol)
            torch.testing.assert_close(view[layers + layer, 2 + i, : len(ctx)], values.transpose(0, 1),
                                       atol=atol, rtol=atol)  # fmt: skip


@pytest.mark.parametrize("bucketed", [False, True])
def test_slot_prefill_gives_each_context_a_plain_forwards_kv_and_logits(tiny_model_dir, monkeypatch, bucketed) -> None:
    monkeypatch.setattr(prefill_module, "PREFILL_TOKENS", 96)  # several forwards, rows out of order
    monkeypatch.setattr(prefill_module, "REPLAY_TOKENS", 0)  # length buckets apart: a forward with a dummy row
    model = load_causal_lm(tiny_model_dir)
    runner = SlotRunner(model, torch.device("cpu"), max_batch=10, max_model_len=64)
    runner.prefiller.bucketed = bucketed
    check_prefill(model, runner, "cpu", 1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_graphed_slot_prefill_gives_each_context_a_plain_forwards_kv_and_logits(tiny_model_dir, monkeypatch) -> None:
    monkeypatch.setattr(prefill_module, "PREFILL_TOKENS", 96)
    monkeypatch.setattr(prefill_module, "REPLAY_TOKENS", 0)
    model = load_causal_lm(tiny_model_dir, device="cuda")
    runner = SlotRunner(model, torch.device("cuda"), max_batch=10, max_model_len=64, graphs=True, fuse=True)
    for _ in range(2):  # the first call records the graphs, the second replays them
        check_prefill(model, runner, "cuda", 1e-4)
        runner.release()
    assert runner.prefiller.graphs and len(runner.prefiller.recorded) >= 2, "the prefill was not graphed"


def test_a_scheduler_on_the_bucketed_slot_prefill_keeps_exact_logprobs(tiny_model_dir, monkeypatch) -> None:
    monkeypatch.setattr(prefill_module, "PREFILL_TOKENS", 64)
    monkeypatch.setattr(prefill_module, "REPLAY_TOKENS", 0)
    model = load_causal_lm(tiny_model_dir)
    runner = SlotRunner(model, torch.device("cpu"), max_batch=16, max_model_len=64)
    runner.prefiller.bucketed = True
    sched = Scheduler(runner, eos_ids=set(), max_batch=16, max_model_len=64, seed=0, prefill_interval=2)
    gen = torch.Generator().manual_seed(11)
    rows = []
    for wave in range(2):  # the second wave comes after every row of the first ended: the batch starts over
        prompts = [torch.randint(4, 100, (n,), generator=gen).tolist() for n in (6, 21, 3, 35)]
        wave_rows = [Row(list(p), SamplingParams(max_tokens=2 + (j + wave) % 5, ignore_eos=True), Future())
                     for p in prompts for j in range(4)]  # fmt: skip
        for row in wave_rows:
            sched.submit(row)
        while sched.rows or sched.waiting:
            sched._step()
        assert runner.slots.rows == 0, "the finished batch released its slots"
        rows += wave_rows
    for row in rows:
        assert row.future.result()[0] == "length"
        want = teacher_forced(model, row.prompt, row.tokens, {})
        assert torch.allclose(torch.tensor(row.logprobs), want, atol=1e-4), (row.logprobs, want.tolist())


def test_a_failed_prefill_fails_its_rows_and_health_counts_them_meanwhile(tiny_model_dir) -> None:
    """A row being prefilled still counts as waiting (an idle `/health` means no row anywhere), and a prefill
    that raises fails the rows it was admitting: their requests get the error instead of waiting forever."""
    runner = SlotRunner(load_causal_lm(tiny_model_dir), torch.device("cpu"), max_batch=4, max_model_len=64)
    sched = Scheduler(runner, eos_ids=set(), max_batch=4, max_model_len=64, seed=0)
    seen, real = [], runner.prefill

    def failing(contexts, images=None):
        seen.append(sched.status())  # on the scheduler thread, mid-step: what `/health` would read now
        raise RuntimeError("out of memory in prefill")

    runner.prefill = failing
    sched.start()
    try:
        rows = [Row([5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True), Future()) for _ in range(2)]
        for row in rows:
            sched.call(lambda row=row: sched.submit(row)).result(timeout=10)
        for row in rows:
            with pytest.raises(RuntimeError, match="engine step failed: out of memory in prefill"):
                row.future.result(timeout=10)
        assert seen and seen[0]["waiting"] + seen[0]["running"] >= 1, seen
        runner.prefill = real  # the engine keeps serving
        again = Row([5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True), Future())
        sched.call(lambda: sched.submit(again)).result(timeout=10)
        assert again.future.result(timeout=30)[0] == "length" and len(again.tokens) == 3
        assert sched.call(sched.status).result(timeout=10)["waiting"] == 0
    finally:
        sched.stop()


def test_a_row_is_answered_only_once_the_engine_counts_it_gone(tiny_model_dir) -> None:
    """When a request's answer is sent, `/health` already shows its row gone and its last step counted: a
    caller that reads the health after its answer sees no running row (a lag here once showed an idle
    engine as running one row, and the step counter moved after the caller had read it)."""
    runner = SlotRunner(load_causal_lm(tiny_model_dir), torch.device("cpu"), max_batch=4, max_model_len=64)
    sched = Scheduler(runner, eos_ids=set(), max_batch=4, max_model_len=64, seed=0)
    seen = []
    rows = [Row([5, 6, 7], SamplingParams(max_tokens=n, ignore_eos=True), Future()) for n in (2, 3)]
    for row in rows:  # the callback runs on the scheduler's thread at the moment the answer is released
        row.future.add_done_callback(lambda _f: seen.append(sched.status()))
        sched.submit(row)
    while sched.rows or sched.waiting:
        sched._step()
    # A step prefills the newcomers and decodes them: max_tokens 2 ends in step 1, 3 in step 2.
    assert [(s["running"], s["steps"]) for s in seen] == [(1, 1), (0, 2)], seen
    aborted = Row([5, 6, 7], SamplingParams(max_tokens=8, ignore_eos=True), Future())
    aborted.future.add_done_callback(lambda _f: seen.append(sched.status()))
    sched.submit(aborted)
    sched._step()
    done: Future = Future()
    sched.pause("abort", done)
    assert aborted.future.result()[0] == "abort" and seen[-1]["running"] == seen[-1]["waiting"] == 0, seen
