"""The slot cache's batch bookkeeping on the CPU: rows that leave are replaced by the last rows (holes filled),
prefills wait for `prefill_interval` steps while rows decode, and through all of it every sampled token's
log-prob equals a teacher-forced forward over the row's whole sequence (the K/V each row attends to are its own).
"""

import itertools
from concurrent.futures import Future

import torch

from molt_hpc.engine.batch import Row
from molt_hpc.engine.sampling import SamplingParams
from molt_hpc.engine.scheduler import Scheduler, fill_holes
from molt_hpc.engine.slots import SlotRunner
from molt_hpc.models import load_causal_lm
from tests.test_engine import teacher_forced


def test_fill_holes_moves_only_the_rows_past_the_kept_count() -> None:
    assert fill_holes([0, 1, 2]) == [0, 1, 2]
    assert fill_holes([]) == []
    assert fill_holes([0, 2, 3, 5]) == [0, 5, 2, 3]  # slot 1 is a hole: row 5 fills it; 4 left
    assert fill_holes([4, 5]) == [4, 5]
    for keep in ([1, 3, 4, 6, 7], [0, 1, 5, 6], [2]):
        order = fill_holes(keep)
        assert sorted(order) == keep, "every kept row once"
        moved = [new for new, old in enumerate(order) if new != old]
        assert len(moved) == sum(i >= len(keep) for i in keep), "only rows past the kept count move"


def test_rows_that_join_and_leave_a_slot_batch_keep_exact_logprobs(tiny_model_dir) -> None:
    model = load_causal_lm(tiny_model_dir)
    runner = SlotRunner(model, torch.device("cpu"), max_batch=6, max_model_len=128)
    interval = 3
    sched = Scheduler(runner, eos_ids=set(), max_batch=6, max_model_len=128, seed=0, prefill_interval=interval)
    gen = torch.Generator().manual_seed(0)
    lengths = [5, 9, 3, 17, 11, 7, 4, 13, 6, 8, 12, 5, 9, 14, 3, 6]
    answers = [6, 2, 9, 4, 3, 8, 5, 2, 7, 9, 3, 11, 4, 6, 2, 5]
    rows = [Row(torch.randint(4, 100, (n,), generator=gen).tolist(), SamplingParams(max_tokens=m, ignore_eos=True),
                Future()) for n, m in zip(lengths, answers, strict=True)]  # fmt: skip
    for row in rows:
        sched.submit(row)
    admitted_at, moved = {}, 0  # step -> (rows decoding before it, rows it prefilled)
    while sched.rows or sched.waiting:
        before = [id(r) for r in sched.rows]
        waiting = len(sched.waiting)
        sched._step()
        if len(sched.waiting) < waiting:
            admitted_at[sched.steps] = (len(before), waiting - len(sched.waiting))
        kept = [i for i in before if i in {id(r) for r in sched.rows}]
        moved += sum(a != b for a, b in zip(kept, [id(r) for r in sched.rows], strict=False))
    steps = sorted(admitted_at)
    assert steps[0] == 1 and len(steps) > 2, admitted_at
    # while rows decode, a prefill of fewer than half a batch waits `interval` steps after the last one
    small = [b - a for a, b in itertools.pairwise(steps) if admitted_at[b][0] and 2 * admitted_at[b][1] < 6]
    assert small and min(small) >= interval, admitted_at
    big = [b - a for a, b in itertools.pairwise(steps) if admitted_at[b][0] and 2 * admitted_at[b][1] >= 6]
    assert big and min(big) < interval, f"a prefill of half a batch never came early: {admitted_at}"
    assert moved > 0, "no row ever moved into a hole: the test misses the slot moves"
    for row, m in zip(rows, answers, strict=True):
        assert row.future.result()[0] == "length" and len(row.tokens) == m
        want = teacher_forced(model, row.prompt, row.tokens, {})
        assert torch.allclose(torch.tensor(row.logprobs), want, atol=1e-4), (row.logprobs, want.tolist())


def test_the_load_meter_reports_each_window_once() -> None:
    from molt_hpc.engine.load import LoadMeter, load_line

    meter = LoadMeter(window_s=10.0, start=100.0)
    meter.add(0.004, prefilled=6, decoded=0, prefill_s=0.003)
    for _ in range(3):
        meter.add(0.002, prefilled=0, decoded=40)
    meter.command_s += 0.5
    assert meter.take(now=109.9) is None, "the window is still open"
    figures = meter.take(now=110.0)
    assert figures is not None
    assert figures["tokens_per_s"] == (120 + 6) / 10.0
    assert abs(figures["busy"] - 0.010 / 10.0) < 1e-12
    assert figures["rows_per_step"] == 120 / 4 and figures["prefills_per_s"] == 1 / 10.0
    assert abs(figures["ms_per_step"] - 10.0 / 4) < 1e-9, "busy milliseconds over the 4 steps"
    assert abs(figures["decode_ms_per_step"] - (10.0 - 3.0) / 4) < 1e-9, "the same without the prefill's 3 ms"
    assert abs(figures["prefill_share"] - 0.3) < 1e-9 and abs(figures["commands"] - 0.05) < 1e-12
    line = load_line(figures)
    assert "13 tok/s" in line and "1.75 without prefills" in line and "30% of busy" in line and "commands 5%" in line
    assert meter.take(now=115.0) is None and meter.decoded == 0 and meter.prefill_s == 0, "a new window starts empty"


def test_samples_of_one_prompt_share_their_prefill_and_keep_exact_logprobs(tiny_model_dir) -> None:
    from molt_hpc.engine.batch import ModelRunner

    model = load_causal_lm(tiny_model_dir)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(4, 100, (n,), generator=gen).tolist() for n in (7, 12, 4)]
    for runner in (ModelRunner(model, torch.device("cpu")), SlotRunner(model, torch.device("cpu"), max_batch=32,
                                                                        max_model_len=64)):  # fmt: skip
        forwarded = []
        prefill = runner.prefill
        runner.prefill = lambda contexts, images, f=prefill, n=forwarded: (
            n.append(len(contexts)),
            f(contexts, images),
        )[1]
        sched = Scheduler(runner, eos_ids=set(), max_batch=32, max_model_len=64, seed=0)
        rows = [
            Row(list(p), SamplingParams(max_tokens=5, ignore_eos=True), Future()) for p in prompts for _ in range(8)
        ]
        for row in rows:
            sched.submit(row)
        while sched.rows or sched.waiting:
            sched._step()
        assert forwarded == [3], f"24 rows of 3 prompts: one forward of the 3 prompts, not {forwarded}"
        assert len({tuple(r.tokens) for r in rows}) > 3, "the samples of one prompt drew their own tokens"
        for row in rows:
            want = teacher_forced(model, row.prompt, row.tokens, {})
            assert torch.allclose(torch.tensor(row.logprobs), want, atol=1e-4), (row.logprobs, want.tolist())
