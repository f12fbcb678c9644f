"""The chat endpoint's `n`, `top_logprobs` and `stream`, through the real `openai` client over loopback HTTP.

Runs on the shared engine pool of the rollout tests (real engines and router). Every reply is checked
against what the endpoint recorded for the trace (the same tokens and log-probs, exactly) and the
recorded log-probs against a teacher-forced forward of the model.
"""

import asyncio
import socket

import aiohttp
import pytest
import torch

from molt_hpc.agents.chat_trace import trajectory_from_calls
from molt_hpc.agents.openai_client import OpenAIPool
from molt_hpc.config import load_config
from molt_hpc.rollout.chat_server import ChatServer
from molt_hpc.rollout.engines import EngineLink
from molt_hpc.rundir import RunDir
from tests.rollout_support import NO_STOP, check_logprobs, pause_all, requests_held, resume_all, wait_until, with_link

openai = pytest.importorskip("openai")  # the `chat` extra; `make test` installs it (dev extra)
pytestmark = pytest.mark.timeout(300)
ASK = [{"role": "user", "content": "reverse: abc"}]


def serve(pool, tok, fn, **cfg):
    """`fn(server, client_of, link)` with a chat endpoint on the pool (its rollout config updated by `cfg`);
    `client_of(session)` is an `AsyncOpenAI` over loopback HTTP bound to that session."""

    async def go(link):
        server = ChatServer(tok, link, pool.cfg.rollout.model_copy(update=cfg), link.token)
        await server.start()
        clients = []

        def client_of(session: str):
            clients.append(openai.AsyncOpenAI(base_url=f"{server.url}/s/{session}/v1", api_key=link.token,
                                              max_retries=0))  # fmt: skip
            return clients[-1]

        try:
            return await fn(server, client_of, link)
        finally:
            for c in clients:
                await c.close()
            await server.close()

    return with_link(pool, go)


def test_n_choices_are_recorded_each_as_its_own_call(pool, tok, model) -> None:
    async def go(server, client_of, link):
        chat = client_of("n3")
        many = await chat.chat.completions.create(model="policy", messages=ASK, n=3, seed=7, max_tokens=8,
                                                    logprobs=True)  # fmt: skip
        calls = server.calls.pop("n3")
        one = await chat.chat.completions.create(model="policy", messages=ASK, seed=7, max_tokens=8)
        return many, calls, one, server.calls.pop("n3")

    many, calls, one, (single,) = serve(pool, tok, go)
    assert [c.index for c in many.choices] == [0, 1, 2] and len(calls) == 3
    for choice, call in zip(many.choices, calls, strict=True):
        assert call.prompt_ids == calls[0].prompt_ids
        assert choice.message.content == tok.decode(call.completion_ids, skip_special_tokens=True)
        assert [e.logprob for e in choice.logprobs.content] == call.logprobs  # exactly what the trace keeps
    assert len({tuple(c.completion_ids) for c in calls}) > 1, "each choice is its own sample"
    assert one.choices[0].message.content == many.choices[0].message.content, "choice 0 keeps the request's seed"
    assert single.completion_ids == calls[0].completion_ids
    assert many.usage.completion_tokens == sum(len(c.completion_ids) for c in calls)
    traj, breaks, dropped = trajectory_from_calls(calls, max_tokens=4096)
    assert breaks == 2 and dropped == 0 and len(traj.action_ranges) == 3, "a segment per choice"
    assert traj.action_logprobs == [lp for c in calls for lp in c.logprobs]
    check_logprobs(model, traj)


def test_top_logprobs_are_the_engines_most_likely_tokens(pool, tok, model) -> None:
    async def go(server, client_of, link):
        reply = await client_of("top").chat.completions.create(model="policy", messages=ASK, logprobs=True,
                                                               top_logprobs=5, max_tokens=6, seed=3)  # fmt: skip
        return reply, server.calls.pop("top")

    reply, (call,) = serve(pool, tok, go)
    content = reply.choices[0].logprobs.content
    assert [e.logprob for e in content] == call.logprobs, "the sampled token's log-prob is unchanged"
    # Temperature 1, no top-k / top-p: the engine's distribution is the model's own softmax.
    logits = teacher_forced_logits(model, call.prompt_ids + call.completion_ids)[len(call.prompt_ids) - 1 :]
    for entry, row, token in zip(content, logits, call.completion_ids, strict=True):
        want, ids = torch.log_softmax(row, -1).topk(5)
        assert len(entry.top_logprobs) == 5
        assert [a.logprob for a in entry.top_logprobs] == pytest.approx(want.tolist(), abs=1e-4)
        assert [a.token for a in entry.top_logprobs] == [tok.decode([int(i)]) for i in ids]
        assert entry.logprob == pytest.approx(torch.log_softmax(row, -1)[token].item(), abs=1e-4)


def teacher_forced_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0, :-1].double()


@pytest.mark.parametrize("abort", [False, True], ids=["frozen", "aborted-and-continued"])
def test_a_streamed_reply_arrives_while_it_is_sampled(pool, tok, abort: bool) -> None:
    """Text comes while the reply is sampled: read while the engines hold the request frozen, before
    anything is recorded; then the rest, adding up to the recorded reply and its log-probs. Aborted there,
    the request continues from its tokens (elsewhere or on the same engine) and the stream goes on as if
    nothing happened. (A long reply, its end-of-turn ignored by the session's overrides, so it is still
    being sampled when the engines are frozen.)"""
    urls = [pool.engine_url(i) for i in range(len(pool.engines)) if pool.engines[i].proc.poll() is None]

    async def go(server, client_of, link):
        server.overrides["live"] = dict(NO_STOP)
        await pause_all(link, urls)
        try:
            stream = await client_of("live").chat.completions.create(
                model="policy", messages=ASK, seed=11, max_tokens=200, stream=True, logprobs=True
            )
            await wait_until(lambda: held(link, urls, 1))
            await resume_all(link, urls, steps=2)  # three tokens (a prefill and two decodes), then frozen again
            await wait_until(lambda: streamed(link, "live", 3))
            early = []
            async for chunk in stream:
                early.append(chunk)
                if any(c.delta.content for c in chunk.choices):
                    break
            recorded_early = "live" in server.calls
            if abort:
                await pause_all(link, urls, mode="abort")
        finally:
            await resume_all(link, urls)
        chunks = early + [c async for c in stream]
        return chunks, recorded_early, server.calls.pop("live"), link.take_counts()

    chunks, recorded_early, (call,), counts = serve(pool, tok, go, max_new_tokens=200, max_total_tokens=256)
    assert not recorded_early, "text came while the reply was still being sampled"
    assert len(call.completion_ids) == 200 and counts["requests_migrated"] == int(abort)
    assert [
        e.logprob for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content
    ] == (call.logprobs)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == tok.decode(call.completion_ids, skip_special_tokens=True)


def test_a_streamed_reply_is_the_recorded_one_chunk_by_chunk(pool, tok, model) -> None:
    """Two choices streamed over HTTP: each choice's chunks add up to the text and log-probs recorded for
    the trace; the usage chunk and `[DONE]` close the stream; the same seeds unstreamed sample the same."""

    async def go(server, client_of, link):
        stream = await client_of("st").chat.completions.create(
            model="policy", messages=ASK, n=2, seed=11, max_tokens=8, logprobs=True, stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        chunks = [c async for c in stream]
        await client_of("st").chat.completions.create(model="policy", messages=ASK, n=2, seed=11, max_tokens=8)
        return chunks, server.calls.pop("st")

    chunks, calls = serve(pool, tok, go)
    streamed_calls, whole_calls = calls[:2], calls[2:]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == sum(
        len(c.completion_ids) for c in streamed_calls
    )
    for index, call in enumerate(streamed_calls):
        mine = [ch.choices[0] for ch in chunks if ch.choices and ch.choices[0].index == index]
        assert mine[0].delta.role == "assistant"
        text = "".join(c.delta.content or "" for c in mine)
        assert text == tok.decode(call.completion_ids, skip_special_tokens=True)
        assert [e.logprob for c in mine if c.logprobs for e in c.logprobs.content] == call.logprobs
        assert mine[-1].finish_reason == call.finish_reason and all(c.finish_reason is None for c in mine[:-1])
        assert call.completion_ids == whole_calls[index].completion_ids, "streamed or not, the same sample"
    traj, breaks, _ = trajectory_from_calls(streamed_calls, max_tokens=4096)
    assert breaks == 1
    check_logprobs(model, traj)


async def held(link, urls: list[str], n: int) -> bool:
    return await requests_held(link, urls) == n


async def streamed(link, session: str, n: int) -> bool:
    partial = link.streaming.get(session)
    return partial is not None and len(partial.token_ids) >= n


def test_a_stream_in_process(pool, tok) -> None:
    """`ctx.openai` (the in-process transport) streams too."""

    async def go(server, client_of, link):
        shared = OpenAIPool(server)
        chat = shared.client(f"{server.url}/s/inproc/v1", server.token)
        stream = await chat.chat.completions.create(model="policy", messages=ASK, seed=2, max_tokens=6, stream=True)
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        await shared.close()
        return text, server.calls.pop("inproc")

    text, (call,) = serve(pool, tok, go)
    assert text == tok.decode(call.completion_ids, skip_special_tokens=True) and call.completion_ids


def test_an_engine_failure_mid_stream_is_an_error_event(tok, tmp_path) -> None:
    """The status line has gone out: the failure comes as OpenAI's streamed `error` event, which the client
    raises; the session's failure is kept for its runner and nothing is recorded."""
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # a real "connection refused": nobody listens
    dead = f"http://127.0.0.1:{closed.getsockname()[1]}"
    cfg = load_config(None, []).rollout

    async def go():
        async with aiohttp.ClientSession() as http:
            link = EngineLink(http, dead, "tok", RunDir(tmp_path), 5.0, resumes=0)
            server = ChatServer(tok, link, cfg, "tok")
            await server.start()
            chat = openai.AsyncOpenAI(base_url=f"{server.url}/s/down/v1", api_key="tok", max_retries=0)
            try:
                stream = await chat.chat.completions.create(model="policy", messages=ASK, stream=True)
                with pytest.raises(openai.APIError, match="engine pool failed"):
                    async for _ in stream:
                        pass
                return server.take("down")
            finally:
                await chat.close()
                await server.close()

    calls, failure = asyncio.run(go())
    closed.close()
    assert calls == [] and "Connect" in failure
