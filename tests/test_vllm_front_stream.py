"""Streamed generates through the vLLM front, and a vLLM engine killed mid-answer whose tokens are kept.

`vllm serve` cannot run here: a builtin engine process on the tiny model stands in for it, with
`tests/vllm_standin.py` (a real process) putting vLLM's streamed `/inference/v1/generate` format on it
(`data: {...}` chunks, then `data: [DONE]`). The front turns those chunks into the builtin engine's
streamed events; the rollout reads them as it reads a builtin engine's, so a killed vLLM's tokens are kept
and continued on another engine through the router.
"""

import asyncio
import contextlib
import copy
import shutil
import subprocess
import sys
from dataclasses import dataclass

import aiohttp
import pytest
import torch
from aiohttp import web

from molt_hpc.config import load_config
from molt_hpc.engine import client
from molt_hpc.engine.stream import Partial, events, generate_streamed
from molt_hpc.engine.vllm.front import Front, build_front
from molt_hpc.engine.vllm.streamed import Streamed, UpstreamBroke
from molt_hpc.net import free_port
from molt_hpc.rollout.engines import EngineLink
from tests.conftest import ROOT
from tests.rollout_support import teacher_forced, wait_until
from tests.test_engine_procs import arun, make_run, spawn, start_engines, wait_registered
from tests.test_vllm_engine import FrontInThread

pytestmark = pytest.mark.timeout(300)
PROMPT = [5, 6, 7, 8]


@dataclass
class Standin:
    proc: subprocess.Popen
    url: str

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


def start_standin(upstream: str, token: str) -> Standin:
    """`tests/vllm_standin.py` over the builtin engine at `upstream`, once it answers."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "vllm_standin.py"), upstream, str(port)], cwd=ROOT)
    url = f"http://127.0.0.1:{port}"

    async def up() -> bool:
        assert proc.poll() is None, "the stand-in exited"
        with contextlib.suppress(aiohttp.ClientError, client.EngineHTTPError):
            async with aiohttp.ClientSession() as s:
                return (await client.health(s, url, token=token))["status"] == "ok"
        return False

    arun(wait_until(up, timeout=60))
    return Standin(proc, url)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model_dir):
    """A run with a router (`run`, no engine yet) and, in a second run directory with the same token, the
    builtin engine that stands in for `vllm serve` (`upstream`) with a stand-in and a front in front of it."""
    root = tmp_path_factory.mktemp("vstream")
    run = make_run(root, "run", tiny_model_dir, "router.health_interval_s=0.5")
    (root / "vllm" / "rendezvous").mkdir(parents=True, mode=0o700)
    shutil.copy(run.token_file, root / "vllm" / "rendezvous" / "token")  # same token: the front's reaches vLLM
    vllm_run = make_run(root, "vllm", tiny_model_dir, "engines.max_batch=4")
    assert vllm_run.token() == run.token()
    [upstream] = start_engines(vllm_run, [0])
    standin = start_standin(upstream.url, run.token())
    front = FrontInThread(load_config(vllm_run.config), vllm_run, 1, standin.proc, standin.url)
    yield run, upstream, front.record()["url"]
    assert front.finish() == 0
    standin.kill()
    assert upstream.stop() == 0


async def raw_events(s: aiohttp.ClientSession, url: str, body: dict, token: str) -> tuple[int, list[dict]]:
    headers = {"Authorization": f"Bearer {token}"}
    async with s.post(url + "/inference/v1/generate", json=body, headers=headers) as r:
        if r.content_type != "text/event-stream":
            return r.status, [await r.json()]
        return r.status, [e async for e in events(r.content)]


def test_a_stream_through_the_front_equals_the_whole_answer(stack) -> None:
    """Seeded, so the whole answer, the streamed one and the engine's own agree; the stream comes in
    several events (one per vLLM chunk) whose tokens are the answer's; a stop token ends both alike."""
    run, upstream, url = stack
    token = run.token()
    sp = {"max_tokens": 12, "seed": 5, "ignore_eos": True, "top_k": 0, "logprobs": None}

    async def go():
        async with aiohttp.ClientSession() as s:
            direct = await client.generate(s, upstream.url, PROMPT, sp, token=token)
            whole = await client.generate(s, url, PROMPT, sp, token=token)
            partial = Partial()
            streamed = await generate_streamed(s, url, PROMPT, sp, partial, token=token)
            status, evs = await raw_events(s, url, {"token_ids": PROMPT, "sampling_params": sp, "stream": True}, token)
            at = next(i for i, t in enumerate(whole.token_ids) if i >= 2 and t not in whole.token_ids[:i])
            stop = {**sp, "ignore_eos": False, "stop_token_ids": [whole.token_ids[at]]}
            stopped = (await client.generate(s, url, PROMPT, stop, token=token),
                       await generate_streamed(s, url, PROMPT, stop, Partial(), token=token))  # fmt: skip
            tokenless = await raw_events(s, url, {"token_ids": PROMPT, "stream": True}, "wrong")
            return direct, whole, streamed, partial, (status, evs), (at, *stopped), tokenless

    direct, whole, streamed, partial, (status, evs), (at, *stopped), tokenless = arun(go())
    assert whole.token_ids == direct.token_ids and whole.logprobs == pytest.approx(direct.logprobs, abs=1e-6)
    assert streamed.token_ids == whole.token_ids and len(streamed.token_ids) == 12
    assert streamed.logprobs == pytest.approx(whole.logprobs, abs=1e-6)
    assert (streamed.finish_reason, whole.finish_reason) == ("length", "length")
    assert streamed.weight_versions == [0] * 12 and streamed.weight_version == 0
    # vLLM spells a top log-prob's token "token_id:N"; the stand-in lists the sampled one.
    assert streamed.top_logprobs == [[(t, lp)] for t, lp in zip(streamed.token_ids, streamed.logprobs, strict=True)]
    assert (partial.token_ids, partial.logprobs) == (streamed.token_ids, streamed.logprobs), "events = answer"
    deltas, final = evs[:-1], evs[-1]
    assert status == 200 and len(deltas) >= 2, "the answer arrives in steps, not at the end"
    assert [t for d in deltas for t in d["token_ids"]] == final["choices"][0]["token_ids"] == whole.token_ids
    assert all(d["weight_versions"] == [0] * len(d["token_ids"]) for d in deltas)
    assert stopped[0].token_ids == stopped[1].token_ids == whole.token_ids[: at + 1]
    assert stopped[0].finish_reason == stopped[1].finish_reason == "stop"
    assert tokenless[0] == 401


def test_streamed_refusals_and_upstream_errors_keep_their_status(stack) -> None:
    run, _, url = stack
    too_long = list(range(4, 100)) * 6  # 576 tokens > engines.max_model_len (512)

    async def go():
        async with aiohttp.ClientSession() as s:
            long = await raw_events(s, url, {"token_ids": too_long, "stream": True}, run.token())
            n2 = {"token_ids": PROMPT, "sampling_params": {"n": 2}, "stream": True}
            return long, await raw_events(s, url, n2, run.token())

    (long_status, [long]), (n_status, [n]) = arun(go())
    assert long_status == 400 and "max_model_len" in long["error"], "vLLM's refusal, before any chunk"
    assert n_status == 400 and "n = 1" in n["error"]


def test_a_refit_mid_stream_stamps_the_start_version(stack) -> None:
    """As for whole answers: a request frozen by a pause while the weights change keeps its start version on
    every token, streamed and in the answer; the answer's `weight_version` is the new one."""
    run, _, url = stack
    token, hdr = run.token(), run.auth_headers()
    sp = {"max_tokens": 200, "ignore_eos": True, "seed": 1}

    async def go():
        async with aiohttp.ClientSession() as s:
            before = (await client.health(s, url, token=token))["weight_version"]
            partial = Partial()
            task = asyncio.create_task(generate_streamed(s, url, PROMPT, sp, partial, token=token))
            await wait_until(lambda: _has(partial, 3))
            for path in ("/pause?mode=keep", "/start_weight_update"):
                async with s.post(url + path, headers=hdr) as r:
                    assert r.status == 200, await r.text()
            assert not task.done(), "the request must be in flight across the update"
            async with s.post(url + "/finish_weight_update", headers=hdr, json={"version": before + 4}) as r:
                assert r.status == 200
            async with s.post(url + "/resume", headers=hdr) as r:
                assert r.status == 200
            return before, await task, partial

    before, res, partial = arun(go())
    assert len(res.token_ids) == 200 and res.weight_version == before + 4
    assert res.weight_versions == [before] * 200 and partial.weight_versions == [before] * 200


def test_under_router_replay_a_streamed_request_is_answered_whole(stack) -> None:
    """vLLM joins a request's routing when it finishes: with router replay the front asks vLLM for a whole
    answer (its routing kept) and the streamed call takes it as its answer, with no events before it."""
    run, upstream, _ = stack
    token = run.token()
    sp = {"max_tokens": 6, "seed": 9, "ignore_eos": True}

    async def go():
        runner = web.AppRunner(build_front(Front(upstream.url, token, 5, routed=True)), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        try:
            async with aiohttp.ClientSession() as s:
                partial = Partial()
                streamed = await generate_streamed(s, url, PROMPT, sp, partial, token=token)
                status, answers = await raw_events(
                    s, url, {"token_ids": PROMPT, "sampling_params": sp, "stream": True}, token
                )
                return (
                    streamed,
                    partial,
                    status,
                    answers,
                    await client.generate(s, upstream.url, PROMPT, sp, token=token),
                )
        finally:
            await runner.cleanup()

    streamed, partial, status, answers, direct = arun(go())
    assert status == 200 and len(answers) == 1 and "choices" in answers[0], "one whole answer, no events"
    assert partial.token_ids == [] and streamed.token_ids == direct.token_ids and len(direct.token_ids) == 6
    assert streamed.logprobs == pytest.approx(direct.logprobs, abs=1e-6)


async def _has(partial: Partial, n: int) -> bool:
    return len(partial.token_ids) >= n


def test_a_killed_vllm_engine_keeps_its_tokens_and_another_engine_continues(stack, model) -> None:
    """A stand-in vLLM (with its own front, behind the router) is SIGKILLed while it holds a request that has
    streamed tokens; the rollout's link keeps them and the router's other engine (a builtin one, started
    while the request is frozen) samples the rest. The answer starts with the kept tokens and log-probs and
    matches a teacher-forced forward over all of it."""
    run, upstream, _ = stack
    token = run.token()
    standin = start_standin(upstream.url, token)
    front = FrontInThread(load_config(run.config), run, 1, standin.proc, standin.url)
    front.record()
    router = wait_registered(run, spawn(run, "router"), "router")
    sp = {"max_tokens": 48, "ignore_eos": True, "temperature": 1.0, "seed": 3}
    engine = None

    async def go():
        nonlocal engine
        async with aiohttp.ClientSession() as s:
            link = EngineLink(s, router.url, token, run, timeout_s=240)
            await wait_until(lambda: _router_healthy(s, router.url, run, 1))
            await client.pause(s, upstream.url, token=token, mode="keep")
            task = asyncio.create_task(link.generate(PROMPT, sp, "session-a"))
            await wait_until(lambda: _held(s, upstream.url, token), timeout=60)
            await client.resume(s, upstream.url, token=token)
            await wait_until(lambda: _has(link.streaming.get("session-a", Partial()), 8))
            await client.pause(s, upstream.url, token=token, mode="keep")
            kept = copy.deepcopy(link.streaming["session-a"])
            engine = await asyncio.to_thread(lambda: start_engines(run, [0])[0])
            await wait_until(lambda: _router_healthy(s, router.url, run, 2))
            standin.kill()  # vLLM dies with the request; the front ends its stream without the answer
            out = await task
            await client.resume(s, upstream.url, token=token)
            async with s.get(router.url + "/metrics", headers=run.auth_headers()) as r:
                return out, kept, link.take_counts(), await r.json()

    try:
        out, kept, counts, metrics = arun(go())
        assert front.done.result(30) == 1, "the front's vLLM died: it stops and unregisters"
        front.loop.call_soon_threadsafe(front.loop.stop)
    finally:
        standin.kill()
        for proc in (engine, router):
            if proc is not None:
                proc.stop()
    n = len(kept.token_ids)
    assert n >= 8 and len(out.token_ids) == 48 and out.finish_reason == "length"
    assert out.token_ids[:n] == kept.token_ids and out.logprobs[:n] == kept.logprobs
    assert out.weight_versions == [0] * 48
    assert counts["requests_migrated"] == 1 and counts["tokens_migrated"] >= n
    assert {e["index"]: e["total"] for e in metrics["engines"]}[0] >= 1, "the builtin engine sampled the rest"
    forced = teacher_forced(model, PROMPT + out.token_ids)[len(PROMPT) - 1 :]
    assert torch.allclose(torch.tensor(out.logprobs, dtype=torch.float64), forced, atol=1e-4)


async def _router_healthy(s: aiohttp.ClientSession, url: str, run, n: int) -> bool:
    async with s.get(url + "/metrics", headers=run.auth_headers()) as r:
        return (await r.json())["healthy"] >= n


async def _held(s: aiohttp.ClientSession, url: str, token: str) -> bool:
    status = await client.health(s, url, token=token)
    return status["running"] + status["waiting"] == 1


def test_vllm_chunks_that_break_a_stream() -> None:
    """vLLM's error chunks (both spellings), a chunk whose log-probs do not line up, or more than one choice
    end the stream with an error event (the caller keeps what came before); usage-only chunks are skipped."""
    streamed = Streamed(start=3)
    content = [{"token": "token_id:7", "logprob": -1.0}, {"token": "token_id:8", "logprob": -2.0}]
    ok = {"request_id": "r", "choices": [{"index": 0, "token_ids": [7, 8], "logprobs": {"content": content}}]}
    assert streamed.take(ok) == {"token_ids": [7, 8], "logprobs": [-1.0, -2.0], "weight_versions": [3, 3]}
    assert streamed.take({"request_id": "r", "choices": [], "usage": {"completion_tokens": 2}}) is None
    bad = [
        ({"error": {"message": "engine dead", "type": "InternalServerError", "code": 500}}, "engine dead"),
        ({"object": "error", "message": "out of memory"}, "out of memory"),
        ({"choices": [{"index": 0, "token_ids": [1], "logprobs": {"content": []}}]}, "1 tokens came with 0"),
        ({"choices": [{"index": 0, "token_ids": []}, {"index": 1, "token_ids": []}]}, "asks for one"),
    ]
    for chunk, needle in bad:
        with pytest.raises(UpstreamBroke, match=needle):
            streamed.take(chunk)
    answer = streamed.answer(now=4, rid="gen-1")
    assert answer["weight_version"] == 4 and answer["id"] == "r"
    assert answer["choices"][0]["token_ids"] == [7, 8] and answer["choices"][0]["weight_versions"] == [3, 3]
    assert answer["choices"][0]["finish_reason"] == "stop", "vLLM's default when no chunk named one"
