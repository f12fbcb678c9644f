"""The built-in engine as a real process on loopback: generate, exact log-probs, batching, auth, bad input."""

import asyncio
import contextlib
import math
import random
import time

import aiohttp
import pytest
import torch

from molt_hpc.engine.client import EngineHTTPError, generate, health, pause, resume
from molt_hpc.engine.sampling import processed_logprobs
from molt_hpc.models import load_causal_lm
from tests.test_engine_procs import arun, make_run, start_engines

VOCAB = 104


@pytest.fixture(scope="module")
def engine(tmp_path_factory, tiny_model_dir):
    run = make_run(tmp_path_factory.mktemp("engine"), "engine", tiny_model_dir, "engines.max_batch=8")
    [proc] = start_engines(run, [0])
    yield proc.url, run.token()
    assert proc.stop() == 0
    assert not (run.rendezvous / "engine-0.json").exists(), "a clean stop unregisters the engine"


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return load_causal_lm(tiny_model_dir)


def teacher_forced(model, prompt: list[int], completion: list[int], sp: dict) -> torch.Tensor:
    """Processed log-probs of `completion` from one forward over prompt+completion (no cache, no batch)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1]
    n = len(completion)
    lp = processed_logprobs(
        logits,
        torch.full((n,), float(sp.get("temperature", 1.0))),
        torch.full((n,), sp.get("top_k", 0)),
        torch.full((n,), float(sp.get("top_p", 1.0))),
        torch.full((n,), float(sp.get("min_p", 0.0))),
    )
    return lp.gather(-1, torch.tensor(completion)[:, None]).view(-1)


def plain_processed(logits: list[float], t: float, k: int, p: float, min_p: float) -> list[float]:
    """The same processing as a plain Python loop over one row."""
    x = [v / (t if t > 0 else 1.0) for v in logits]
    order = sorted(range(len(x)), key=lambda i: -x[i])
    keep = set(order[:k] if k > 0 else order)
    z = sum(math.exp(x[i]) for i in keep)
    mass, nucleus = 0.0, set()
    for i in order:
        if i in keep and mass < p:
            nucleus.add(i)
            mass += math.exp(x[i]) / z
    z = sum(math.exp(x[i]) for i in nucleus)
    top = max(math.exp(x[i]) / z for i in nucleus)
    final = {i for i in nucleus if math.exp(x[i]) / z >= min_p * top}
    z = sum(math.exp(x[i]) for i in final)
    return [x[i] - math.log(z) if i in final else -math.inf for i in range(len(x))]


def test_processing_matches_a_plain_loop() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 12, generator=gen) * 2
    params = [(1.0, 0, 1.0, 0.0), (0.7, 3, 1.0, 0.0), (1.3, 0, 0.6, 0.0), (1.0, 5, 0.8, 0.2), (0.0, 0, 1.0, 0.0)]
    got = processed_logprobs(logits, *(torch.tensor([p[j] for p in params]) for j in range(4)))
    for row, (t, k, p, m) in enumerate(params):
        want = torch.tensor(plain_processed(logits[row].tolist(), t, k, p, m))
        assert torch.equal(torch.isinf(got[row]), torch.isinf(want)), (row, got[row], want)
        finite = ~torch.isinf(want)
        assert torch.allclose(got[row][finite], want[finite], atol=1e-5)


def test_generate_round_trip(engine) -> None:
    url, token = engine

    async def go():
        async with aiohttp.ClientSession() as s:
            return await generate(s, url, [5, 6, 7, 8], {"max_tokens": 7, "ignore_eos": True}, token=token)

    res = arun(go())
    assert len(res.token_ids) == len(res.logprobs) == len(res.weight_versions) == 7
    assert res.finish_reason == "length"
    assert all(0 <= t < VOCAB for t in res.token_ids) and all(lp <= 0 for lp in res.logprobs)
    assert res.weight_versions == [0] * 7 and res.weight_version == 0


def test_logprobs_exact_for_requests_that_join_a_running_batch(engine, reference) -> None:
    """Every token's log-prob equals a teacher-forced forward (1e-5), for the first request and the ones
    that joined its batch mid-way with other prompt lengths and sampling parameters."""
    url, token = engine
    rng = random.Random(0)
    first = ([rng.randrange(4, VOCAB) for _ in range(9)], {"max_tokens": 60, "ignore_eos": True, "temperature": 0.8})
    joiners = [
        ([rng.randrange(4, VOCAB) for _ in range(n)], sp)
        for n, sp in [
            (3, {"max_tokens": 20, "top_k": 10}),
            (30, {"max_tokens": 25, "top_p": 0.9, "temperature": 1.3}),
            (17, {"max_tokens": 12, "temperature": 0.0}),
            (5, {"max_tokens": 30, "min_p": 0.05, "top_k": 40, "seed": 7}),
            (44, {"max_tokens": 8, "top_p": 0.5}),
        ]
    ]

    async def go():
        async with aiohttp.ClientSession() as s:
            long = asyncio.create_task(generate(s, url, *first, token=token))
            while (await health(s, url, token=token))["running"] < 1:
                await asyncio.sleep(0.005)
            assert not long.done(), "the joiners must arrive while the first request is running"
            rest = [generate(s, url, p, sp, token=token) for p, sp in joiners]
            return await asyncio.gather(long, *rest)

    results = arun(go())
    for (prompt, sp), res in zip([first, *joiners], results, strict=True):
        assert res.token_ids, sp
        want = teacher_forced(reference, prompt, res.token_ids, sp)
        got = torch.tensor(res.logprobs)
        assert (want - got).abs().max().item() < 1e-5, (sp, want, got)
        if sp.get("temperature") == 0.0:
            with torch.no_grad():
                logits = reference(torch.tensor([prompt + res.token_ids])).logits[0, len(prompt) - 1 : -1]
            assert res.token_ids == logits.argmax(-1).tolist()


def test_concurrent_requests_decode_together(engine) -> None:
    url, token = engine
    n, length = 8, 24

    async def go():
        async with aiohttp.ClientSession() as s:
            before = (await health(s, url, token=token))["steps"]
            sp = {"max_tokens": length, "ignore_eos": True}
            outs = await asyncio.gather(*[generate(s, url, [10 + i] * (3 + i), sp, token=token) for i in range(n)])
            after = (await health(s, url, token=token))["steps"]
            long = asyncio.create_task(generate(s, url, [9, 9], {"max_tokens": 400, "ignore_eos": True}, token=token))
            short = await generate(s, url, [8, 8], {"max_tokens": 3, "ignore_eos": True}, token=token)
            short_done_first = not long.done()
            await long
            return outs, after - before, short, short_done_first

    outs, steps, short, short_done_first = arun(go())
    assert all(len(o.token_ids) == length for o in outs)
    # serialised decoding would take n × length steps; batched takes about `length` (+ staggered arrivals)
    assert steps < 2 * length, steps
    assert len(short.token_ids) == 3 and short_done_first, "a short request is not queued behind a long one"


def test_seed_reproduces_and_stop_tokens_end_requests(engine) -> None:
    url, token = engine

    async def go():
        async with aiohttp.ClientSession() as s:
            sp = {"max_tokens": 16, "ignore_eos": True, "seed": 123}
            a = await generate(s, url, [20, 21, 22], sp, token=token)
            b = await generate(s, url, [20, 21, 22], sp, token=token)
            c = await generate(s, url, [20, 21, 22], {**sp, "seed": 124}, token=token)
            stop = await generate(s, url, [20], {"max_tokens": 5, "stop_token_ids": list(range(VOCAB))}, token=token)
            return a, b, c, stop

    a, b, c, stop = arun(go())
    assert a.token_ids == b.token_ids and a.token_ids != c.token_ids
    assert stop.finish_reason == "stop" and len(stop.token_ids) == 1, "the stop token ends the request, included"


BAD_BODIES = [
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "JSON object"),
    (b'{"token_ids": []}', "token_ids"),
    (b'{"token_ids": "abc"}', "token_ids"),
    (b'{"token_ids": [1, 2, 104]}', "outside the vocabulary"),
    (b'{"token_ids": [-1]}', "outside the vocabulary"),
    (b'{"token_ids": [1], "sampling_params": {"max_tokens": -3}}', "max_tokens"),
    (b'{"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 510}}', "max_model_len"),
    (b'{"token_ids": [1], "sampling_params": {"temperature": "hot"}}', "temperature"),
    (b'{"token_ids": [1], "sampling_params": {"top_p": 0}}', "top_p"),
    (b'{"token_ids": [1], "sampling_params": {"stop_token_ids": [999]}}', "outside the vocabulary"),
    (b'{"token_ids": [1], "sampling_params": {"n": 2}}', "not supported"),
    (b'{"token_ids": [1], "sampling_params": {"tempreature": 1}}', "tempreature"),
]


def test_auth_and_bad_input_are_refused_and_the_engine_keeps_serving(engine) -> None:
    url, token = engine

    async def go():
        out = []
        async with aiohttp.ClientSession() as s:
            for path, method in [("/health", "GET"), ("/inference/v1/generate", "POST"), ("/update_weights", "POST")]:
                for hdrs in [{}, {"Authorization": "Bearer wrong"}, {"Authorization": token}]:
                    async with s.request(method, url + path, headers=hdrs, data=b"{}") as r:
                        out.append((path, r.status))
            good = {"Authorization": f"Bearer {token}"}
            bad = []
            for body, _ in BAD_BODIES:
                async with s.post(url + "/inference/v1/generate", headers=good, data=body) as r:
                    bad.append((r.status, (await r.json())["error"]))
            async with s.post(url + "/pause?mode=sideways", headers=good) as r:
                bad.append((r.status, (await r.json())["error"]))
            ok = await generate(s, url, [1, 2, 3], {"max_tokens": 2}, token=token)
            with pytest.raises(EngineHTTPError) as err:
                await generate(s, url, [1, 2, 3], {"max_tokens": 0}, token=token)
            return out, bad, ok, err.value

    out, bad, ok, err = arun(go())
    assert all(status == 401 for _, status in out), out
    for (status, message), (_, needle) in zip(bad, [*BAD_BODIES, (None, "sideways")], strict=True):
        assert status == 400 and needle in message, (status, message, needle)
    assert len(ok.token_ids) >= 1 and err.status == 400 and "max_tokens" in err.message


def test_pause_keep_abort_wait(engine) -> None:
    url, token = engine
    auth = {"Authorization": f"Bearer {token}"}
    sp = {"ignore_eos": True}

    async def post(s, path):
        async with s.post(url + path, headers=auth) as r:
            assert r.status == 200, await r.text()
            return await r.json()

    async def go():
        async with aiohttp.ClientSession() as s:
            # keep: the request is frozen (no steps) and completes in full after resume. Long requests (500
            # decode steps) are still running when the pause lands right after they start.
            task = asyncio.create_task(generate(s, url, [3, 4], {**sp, "max_tokens": 500}, token=token))
            while (await health(s, url, token=token))["running"] < 1:
                await asyncio.sleep(0.005)
            paused = await post(s, "/pause?mode=keep")
            steps = (await health(s, url, token=token))["steps"]
            await asyncio.sleep(0.3)
            frozen = (await health(s, url, token=token))["steps"] == steps and not task.done()
            await post(s, "/resume")
            kept = await task
            # abort: the in-flight request ends now; a request sent while paused waits for resume
            task = asyncio.create_task(generate(s, url, [3, 4], {**sp, "max_tokens": 500}, token=token))
            while (await health(s, url, token=token))["running"] < 1:
                await asyncio.sleep(0.005)
            await post(s, "/pause?mode=abort")
            aborted = await task
            held = asyncio.create_task(generate(s, url, [3, 4], {**sp, "max_tokens": 4}, token=token))
            while (await health(s, url, token=token))["waiting"] < 1:  # it reached the engine, which holds it
                await asyncio.sleep(0.005)
            held_waits = not held.done()
            await post(s, "/resume")
            after = await held
            # wait: pause returns once the in-flight request has finished on its own
            task = asyncio.create_task(generate(s, url, [3, 4], {**sp, "max_tokens": 40}, token=token))
            while (await health(s, url, token=token))["running"] < 1:
                await asyncio.sleep(0.005)
            # (the pause's own answer says so: the generate answer may still be on its way to us)
            status = await post(s, "/pause?mode=wait")
            drained = status["running"] == 0 and status["waiting"] == 0
            await post(s, "/resume")
            waited = await task
            return paused, frozen, kept, aborted, held_waits, after, drained, waited

    paused, frozen, kept, aborted, held_waits, after, drained, waited = arun(go())
    assert paused["paused"] and paused["running"] == 1 and frozen
    assert kept.finish_reason == "length" and len(kept.token_ids) == 500
    assert aborted.finish_reason == "abort" and len(aborted.token_ids) < 500
    assert held_waits and after.finish_reason == "length" and len(after.token_ids) == 4
    assert drained and waited.finish_reason == "length" and len(waited.token_ids) == 40


def test_resume_for_a_number_of_steps_freezes_the_requests_again(engine) -> None:
    """`resume(steps=n)` runs exactly n scheduler steps and pauses itself: a newcomer holds n + 1 tokens (its
    first step prefills, sampling one, then decodes one), a running request n more; whatever the timing of
    the calls that follow."""
    url, token = engine
    sp = {"ignore_eos": True, "max_tokens": 500}

    async def frozen(s) -> dict:
        while not (h := await health(s, url, token=token))["paused"]:
            await asyncio.sleep(0.005)
        return h

    async def go():
        async with aiohttp.ClientSession() as s:
            await pause(s, url, token=token, mode="keep")
            task = asyncio.create_task(generate(s, url, [3, 4], sp, token=token))
            while (await health(s, url, token=token))["waiting"] < 1:  # held by the paused engine
                await asyncio.sleep(0.005)
            start = (await health(s, url, token=token))["steps"]
            await resume(s, url, token=token, steps=7)
            first = await frozen(s)
            await asyncio.sleep(0.3)  # frozen: no step runs until the next call
            still = await health(s, url, token=token)
            await resume(s, url, token=token, steps=5)
            second = await frozen(s)
            await pause(s, url, token=token, mode="abort")  # the answer so far: the tokens the steps made
            out = await task
            await resume(s, url, token=token)
            return start, first, still, second, out

    start, first, still, second, out = arun(go())
    assert first["steps"] - start == 7 and first["running"] == 1 and still["steps"] == first["steps"]
    assert second["steps"] - start == 12 and second["running"] == 1
    assert out.finish_reason == "abort" and len(out.token_ids) == 12 + 1


def test_a_client_that_leaves_frees_its_row(engine) -> None:
    url, token = engine
    auth = {"Authorization": f"Bearer {token}"}

    async def go():
        async with aiohttp.ClientSession() as s:
            sp = {"max_tokens": 500, "ignore_eos": True}
            task = asyncio.create_task(generate(s, url, [3, 4], sp, token=token))
            while (await health(s, url, token=token))["running"] < 1:  # decoding
                await asyncio.sleep(0.005)
            async with s.post(url + "/pause?mode=keep", headers=auth) as r:  # frozen: it cannot finish now
                assert r.status == 200
            task.cancel()  # the client leaves
            with contextlib.suppress(asyncio.CancelledError):
                await task
            deadline = time.monotonic() + 60
            while ((h := await health(s, url, token=token))["running"] or h["waiting"]) and time.monotonic() < deadline:
                await asyncio.sleep(0.005)  # only the client's leaving can empty a frozen engine
            async with s.post(url + "/resume", headers=auth) as r:
                assert r.status == 200
            return h

    freed = arun(go())
    assert freed["paused"] and freed["running"] == 0 and freed["waiting"] == 0
