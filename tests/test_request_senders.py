"""What our own code sends to the router, the vLLM front and the scorer passes their typed request models.

A full-featured rollout (top-k, top-p, temperature, per-turn seeds, an env's per-turn overrides, greedy
evaluation overrides, router-replay routing capture, images of a vision-language prompt) and the chat
endpoint (OpenAI sampling fields, the largest seed it accepts) send through the real client code to a
recording server on loopback; every body that arrived is then validated as the router and the vLLM
front validate it. The scorer client's classify bodies likewise; the refit's bodies at the config's
largest timeout too.
"""

import asyncio
import io
import json

import aiohttp
import numpy as np
import pytest
from aiohttp import web
from PIL import Image

from molt_hpc.agents.base import Env, Result
from molt_hpc.agents.step_runner import StepEnvRunner
from molt_hpc.config import load_config
from molt_hpc.config.load import ConfigError
from molt_hpc.config.stages import RewardModelConfig
from molt_hpc.data import Prompt
from molt_hpc.engine.routing import encode_routing
from molt_hpc.engine.vllm.front import normalise_generate
from molt_hpc.models import build_tiny_tokenizer
from molt_hpc.protocol.edge import loads, parse
from molt_hpc.protocol.requests import GenerateRequest, InitRequest, RpcRequest
from molt_hpc.refit.calls import HTTP_GRACE_S
from molt_hpc.rollout.chat_server import ChatServer
from molt_hpc.rollout.engines import EngineLink
from molt_hpc.rundir import RunDir
from molt_hpc.scorer.client import ScorerClient
from molt_hpc.scorer.registry import register_scorer
from molt_hpc.scorer.request import ClassifyRequest
from molt_hpc.trajectory import TraceImage

GREEDY = {"temperature": 0.0, "top_k": 1, "top_p": 1.0}  # `[eval]` with temperature 0 (rollout.evaluation)
FULL = ["rollout.temperature=0.7", "rollout.top_p=0.9", "rollout.top_k=40", "rollout.max_new_tokens=64",
        "rollout.max_total_tokens=512", "rollout.max_turns=3"]  # fmt: skip


class TwoTurns(Env):
    """Asks once more with its own sampling overrides, then ends."""

    def step(self, state):
        if state.turn == 0:
            overrides = {"temperature": 0.3, "min_p": 0.05, "logprobs": 2, "ignore_eos": True, "max_tokens": 4}
            return Result(observation="again", terminated=False, sampling_params=overrides)
        return Result(reward=1.0)


async def recording_server(seen: list[tuple[str, bytes]]) -> tuple[web.AppRunner, str]:
    """Answers generate like an engine (with routing rows when asked) and classify like a scorer."""

    async def generate(request: web.Request) -> web.Response:
        raw = await request.read()
        seen.append((request.path, raw))
        body = json.loads(raw)
        out = [40, 41, 2]
        start = body["sampling_params"].get("routed_experts_prompt_start", 0)
        rows = np.zeros((len(body["token_ids"]) + len(out) - 1 - start, 2, 2), dtype=np.uint8)
        content = [{"token_id": t, "logprob": -1.0} for t in out]
        choice = {"token_ids": out, "logprobs": {"content": content}, "finish_reason": "stop",
                  "routed_experts": encode_routing(rows)}  # fmt: skip
        return web.json_response({"choices": [choice], "weight_version": 0})

    async def classify(request: web.Request) -> web.Response:
        raw = await request.read()
        seen.append((request.path, raw))
        n = len(json.loads(raw)["input"])
        return web.json_response({"data": [{"index": i, "probs": [0.5]} for i in range(n)]})

    app = web.Application()
    app.add_routes([web.post("/inference/v1/generate", generate), web.post("/classify", classify)])
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"


def png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (28, 28), (200, 30, 30)).save(buf, format="PNG")
    return buf.getvalue()


def test_generate_and_classify_bodies_of_a_full_featured_run_pass_the_typed_models(tmp_path) -> None:
    """Streamed, as the rollout asks every engine (the builtin ones and the vLLM fronts); the recording
    server answers whole, which a streamed call takes too."""
    cfg = load_config(None, FULL)
    tok = build_tiny_tokenizer()
    run = RunDir(tmp_path)
    run.rendezvous.mkdir()
    ids = tok("describe the picture")["input_ids"]
    image = TraceImage(png(), offset=2, length=4, grid=(1, 4, 4))
    prompt = Prompt("p", 0, "describe the picture", None, [*ids[:2], *[5] * 4, *ids[2:]], images=(image,))
    seen: list[tuple[str, bytes]] = []

    async def go():
        runner, url = await recording_server(seen)
        async with aiohttp.ClientSession() as s:
            link = EngineLink(s, url, "tok", run, 30.0)
            steps = StepEnvRunner(TwoTurns, tok, cfg.rollout, link.generate, seed=2**62, routed_experts=True)
            await steps.run(prompt, rollout_id="r0", group_id="g0")
            await steps.run(prompt, rollout_id="e0", group_id="eval", overrides=GREEDY)
            chat = ChatServer(tok, link, cfg.rollout, "tok")
            chat_url = await chat.start()
            chat.overrides["greedy-session"] = dict(GREEDY)
            ask = {"messages": [{"role": "user", "content": "hi"}], "temperature": 2.0, "top_p": 0.5,
                   "seed": 2**64 - 1, "max_completion_tokens": 8, "user": "u"}  # fmt: skip
            for session in ("s1", "greedy-session"):
                async with s.post(f"{chat_url}/s/{session}/v1/chat/completions", json=ask,
                                  headers={"Authorization": "Bearer tok"}) as r:  # fmt: skip
                    assert r.status == 200, await r.text()
            await chat.close()
            register_scorer(run, 0, url, "builtin")
            await ScorerClient(s, run, "tok", RewardModelConfig(path="rm")).score([[2, 30, 3], [2, 50, 51, 3]])
        await runner.cleanup()

    asyncio.run(go())
    generate = [loads(raw) for path, raw in seen if path == "/inference/v1/generate"]
    classify = [loads(raw) for path, raw in seen if path == "/classify"]
    assert len(generate) == 6 and len(classify) == 1, [path for path, _ in seen]
    for body in generate:  # what the router and the vLLM front check before they forward
        parse(GenerateRequest, body)
        assert body.get("stream") is True
        parse(GenerateRequest, normalise_generate(body))  # and what the front sends on to vLLM
    parse(ClassifyRequest, classify[0])
    sent = [b["sampling_params"] for b in generate]
    assert sent[0]["top_k"] == 40 and sent[0]["top_p"] == 0.9 and sent[0]["temperature"] == 0.7
    assert all(isinstance(sp["seed"], int) for sp in sent[:4]) and sent[4]["seed"] == 2**64 - 1
    assert sent[1]["min_p"] == 0.05 and sent[1]["logprobs"] == 2 and sent[1]["ignore_eos"] is True
    assert sent[1]["routed_experts_prompt_start"] > 0, "the second turn asks only for the new routing"
    assert sent[2]["top_k"] == 1 and sent[5]["top_k"] == 1, "greedy evaluation and the chat session's override"
    assert all(b["mm"]["spans"] == [[2, 4]] for b in generate[:4]) and "mm" not in generate[4]


def test_refit_bodies_at_the_largest_timeout_the_config_accepts() -> None:
    """The refit sends `refit.timeout_s` in its init and (plus a grace) its vLLM RPC calls: the config's
    bound and the routes' bounds agree, and a larger timeout is refused when the config is read."""
    timeout = load_config(None, ["refit.timeout_s=86400"]).refit.timeout_s
    group = {"master_address": "node-17.cluster", "master_port": 29500, "rank_offset": 3, "world_size": 9,
             "group_name": "refit/12/", "backend": "nccl", "timeout_s": timeout}  # fmt: skip
    parse(InitRequest, {"init_info": group})  # as refit/sender.py sends it
    parse(InitRequest, {"init_info": {"backend": "ipc", "ipc": {"slots": []}, "timeout_s": timeout}})
    parse(
        InitRequest,
        {"init_info": {k: group[k] for k in ("master_address", "master_port", "rank_offset", "world_size")}},
    )
    rpc = {
        "method": "molt_ipc_init",
        "args": [json.dumps({"timeout_s": timeout})],
        "timeout": timeout + HTTP_GRACE_S / 2,
    }
    parse(RpcRequest, rpc)  # as refit/vllm_sender.py sends it
    for bad in ("refit.timeout_s=86401", "refit.timeout_s=inf", "rollout.temperature=nan"):
        with pytest.raises(ConfigError, match=r"refit\.timeout_s|rollout\.temperature"):
            load_config(None, [bad])
