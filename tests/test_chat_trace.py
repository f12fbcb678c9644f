"""A chat-mode trace rebuilt from the endpoint's calls: segments, their log-probs and routing, the buffer
round trip, and the trainer's forward over a segmented sample (each segment its own sequence)."""

import asyncio
import json

import aiohttp
import numpy as np
import pytest
import torch
from aiohttp import web

from molt_hpc.actor.batch import policy_logprobs
from molt_hpc.agents.chat_trace import ChatCall, routing_start, trajectory_from_calls
from molt_hpc.algorithm import make_experience
from molt_hpc.buffer.codec import decode_group, encode_group
from molt_hpc.config import load_config
from molt_hpc.engine.routing import encode_routing
from molt_hpc.models import build_tiny_tokenizer
from molt_hpc.protocol.edge import parse
from molt_hpc.rollout.chat_schema import ChatRequest
from molt_hpc.rollout.chat_server import ChatServer
from molt_hpc.rollout.engines import EngineLink
from molt_hpc.rundir import RunDir
from molt_hpc.trajectory import Group, Trajectory


def call(prompt, completion, version=0, routed=None, routed_from=0) -> ChatCall:
    lps = [-0.5 * (i + 1) - version for i in range(len(completion))]  # distinct, exact in float32
    return ChatCall(list(prompt), list(completion), lps, [version] * len(completion), "stop", routed, routed_from)


def test_calls_that_extend_form_one_segment_with_the_engines_logprobs() -> None:
    calls = [call([1, 2], [3, 4], 0), call([1, 2, 3, 4, 5], [6], 1)]
    traj, breaks, dropped = trajectory_from_calls(calls, max_tokens=64)
    assert (traj.tokens, traj.prompt_len, traj.action_ranges, traj.segments) == (
        [1, 2, 3, 4, 5, 6],
        2,
        [(2, 4), (5, 6)],
        [],
    )
    assert traj.action_logprobs == calls[0].logprobs + calls[1].logprobs and traj.versions == [0, 0, 1]
    assert (breaks, dropped) == (0, 0)


def test_a_prefix_break_opens_a_segment_and_keeps_every_action() -> None:
    calls = [call([1, 2], [3, 4], 0), call([1, 2, 9, 9], [7], 2)]  # the template re-rendered the history
    traj, breaks, dropped = trajectory_from_calls(calls, max_tokens=64)
    assert traj.tokens == [1, 2, 3, 4, 1, 2, 9, 9, 7] and traj.segments == [4] and traj.prompt_len == 2
    assert traj.action_ranges == [(2, 4), (8, 9)] and traj.versions == [0, 0, 2]
    assert traj.action_logprobs == calls[0].logprobs + calls[1].logprobs
    assert (breaks, dropped) == (1, 0)
    assert traj.response_len == 5 - 2  # the last segment (the conversation as last rendered) after the prompt


def test_a_call_continues_the_segment_it_extends_not_only_the_last() -> None:
    main1, side, main2 = call([1, 2], [3], 0), call([8, 8], [9], 0), call([1, 2, 3, 5], [6], 1)
    traj, breaks, _ = trajectory_from_calls([main1, side, main2], max_tokens=64)
    assert traj.tokens == [1, 2, 3, 5, 6, 8, 8, 9] and traj.segments == [5]
    assert traj.action_ranges == [(2, 3), (4, 5), (7, 8)] and traj.versions == [0, 1, 0]
    assert traj.action_logprobs == main1.logprobs + main2.logprobs + side.logprobs and breaks == 1


def test_segments_past_the_budget_leave_the_earliest_out() -> None:
    calls = [call([1, 2], [3, 4]), call([5, 6, 7], [8]), call([9, 9, 9], [1, 2])]
    traj, breaks, dropped = trajectory_from_calls(calls, max_tokens=9)
    assert traj.tokens == [5, 6, 7, 8, 9, 9, 9, 1, 2] and traj.segments == [4] and traj.prompt_len == 3
    assert (breaks, dropped) == (2, 1)
    traj, _, dropped = trajectory_from_calls(calls, max_tokens=3)  # the last segment is always kept
    assert traj.tokens == [9, 9, 9, 1, 2] and dropped == 2


def test_routing_rows_per_segment_each_from_the_call_that_first_saw_the_position() -> None:
    def rows(start, end, base):
        return np.arange(start, end, dtype=np.int16)[:, None, None] + base

    first = call([1, 2], [3, 4], routed=rows(0, 3, 100))  # positions 0..2 (the last token is never forwarded)
    assert routing_start([first], [1, 2, 3, 4, 5]) == 3 and routing_start([first], [7, 7]) == 0
    second = call([1, 2, 3, 4, 5], [6], routed=rows(3, 5, 200), routed_from=3)
    other = call([7, 7], [8], routed=rows(0, 2, 300))
    traj, _, _ = trajectory_from_calls([first, second, other], max_tokens=64)
    got = traj.routed_experts[:, 0, 0].tolist()
    assert got == [100, 101, 102, 203, 204, -1, 300, 301, -1]
    wrong = call([1, 2, 3, 4, 5], [6], routed=rows(0, 5, 200))  # the rows of positions already covered
    assert trajectory_from_calls([first, wrong], max_tokens=64)[0].routed_experts is None  # never misaligned


def test_a_segmented_group_survives_the_buffer_codec() -> None:
    traj, _, _ = trajectory_from_calls([call([1, 2], [3, 4]), call([1, 2, 9, 9], [7], 2)], max_tokens=64)
    group = Group("g", "p", [traj, trajectory_from_calls([call([5], [6])], max_tokens=64)[0]])
    back = decode_group(encode_group(group))
    assert back.samples == group.samples and back.samples[0].segments == [4] and back.samples[1].segments == []


@pytest.mark.parametrize("segments", [[0], [2], [3, 5], [6]])
def test_a_segment_never_opens_on_an_action_nor_inside_the_first_prompt(segments) -> None:
    with pytest.raises(AssertionError):
        Trajectory([1] * 8, 2, [(2, 4), (5, 7)], [0.0] * 4, [0] * 4, segments=segments)


def test_the_trainer_forwards_each_segment_as_its_own_sequence(tiny_model_dir) -> None:
    """The log-probs of a segmented sample equal those of its segments as separate samples, padded and packed."""
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    one, two = (torch.randint(4, 90, (n,), generator=g).tolist() for n in (9, 12))
    whole = Trajectory(one + two, 4, [(4, 9), (17, 21)], [0.0] * 9, [0] * 9, segments=[9])
    parts = [Trajectory(one, 4, [(4, 9)], [0.0] * 5, [0] * 5), Trajectory(two, 8, [(8, 12)], [0.0] * 4, [0] * 4)]
    with torch.no_grad():
        want = torch.cat([_actions(policy, make_experience([p], max_len=32)) for p in parts])
        for pack in (False, True):
            exp = make_experience([whole], max_len=32, pack=pack)
            assert exp.position_ids[0, :21].tolist() == list(range(9)) + list(range(12))
            got = _actions(policy, exp)
            assert torch.allclose(got, want, atol=1e-5), (pack, (got - want).abs().max())
        joined = make_experience([Trajectory(one + two, 4, [(4, 9), (17, 21)], [0.0] * 9, [0] * 9)], max_len=32)
        assert not torch.allclose(_actions(policy, joined), want, atol=1e-3)  # one sequence would differ


def _actions(policy, exp) -> torch.Tensor:
    return policy_logprobs(policy, exp, 1.0, 8)[0][exp.action_mask]


def test_the_endpoint_asks_each_segment_only_for_the_routing_it_lacks(tmp_path) -> None:
    """Router replay in chat mode: through the chat endpoint to a recording engine on loopback, a call that
    continues a segment asks for the routing of its new positions only, a call that opens one for all."""

    tok, cfg, starts = build_tiny_tokenizer(), load_config(None, ["rollout.max_total_tokens=256"]), []
    out = [*tok("ok", add_special_tokens=False)["input_ids"], tok.eos_token_id]

    async def generate(request: web.Request) -> web.Response:
        body = json.loads(await request.read())
        start = body["sampling_params"]["routed_experts_prompt_start"]
        starts.append((start, len(body["token_ids"])))
        rows = np.arange(start, len(body["token_ids"]) + len(out) - 1, dtype=np.uint8)[:, None, None]
        content = [{"token_id": t, "logprob": -0.5} for t in out]
        choice = {"token_ids": out, "logprobs": {"content": content}, "finish_reason": "stop",
                  "routed_experts": encode_routing(rows)}  # fmt: skip
        return web.json_response({"choices": [choice], "weight_version": 0})

    async def go():
        app = web.Application()
        app.add_routes([web.post("/inference/v1/generate", generate)])
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        (tmp_path / "rendezvous").mkdir()
        async with aiohttp.ClientSession() as s:
            chat = ChatServer(
                tok, EngineLink(s, url, "tok", RunDir(tmp_path), 30.0), cfg.rollout, "tok", routed_experts=True
            )
            first = [{"role": "user", "content": "hi"}]
            for messages in (first, [*first, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "x"}],
                             [{"role": "user", "content": "other"}]):  # fmt: skip
                status, answer = await chat.complete(parse(ChatRequest, {"messages": messages}), "s")
                assert status == 200, answer
            calls, _ = chat.take("s")
        await runner.cleanup()
        return calls

    calls = asyncio.run(go())
    (s1, p1), (s2, p2), (s3, _) = starts
    assert (s1, s2, s3) == (0, p1 + len(out) - 1, 0)
    traj, breaks, _ = trajectory_from_calls(calls, max_tokens=256)
    assert breaks == 1 and traj.segments == [p2 + len(out)]
    assert traj.routed_experts[: p2 + len(out) - 1, 0, 0].tolist() == [i % 256 for i in range(p2 + len(out) - 1)]
    assert traj.routed_experts[p2 + len(out) - 1, 0, 0] == -1  # the segment's last token: never forwarded
