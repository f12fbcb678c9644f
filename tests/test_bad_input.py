"""Bad input at every server's edge: a 4xx with its reason, nothing changed, the server still healthy.

Real processes on loopback: an engine and the router (`jobs/engine.py`), the chat endpoint on a real
aiohttp server. Each class of bad input (wrong types, nulls, non-finite numbers, bad encodings,
traversal and control characters in paths, stateful routes with invalid bodies) is sent as raw bytes.
"""

import asyncio

import aiohttp
import pytest

from molt_hpc.config import load_config
from molt_hpc.models import load_tokenizer
from molt_hpc.rollout.chat_server import ChatServer
from tests.test_engine_pool import wait_healthy
from tests.test_engine_procs import arun, get_json, make_run, spawn, wait_registered

GEN = "/inference/v1/generate"
BAD_GENERATE = [
    (b'{"token_ids": [1, 2], "sampling_params": {"temperature": 1e999}}', "finite"),
    (b'{"token_ids": [1, 2], "sampling_params": {"temperature": Infinity}}', "finite"),
    (b'{"token_ids": [1, 2], "sampling_params": {"top_p": NaN}}', "finite"),
    (b'{"token_ids": [1, 2], "sampling_params": {"temperature": "hot"}}', "temperature"),
    (b'{"token_ids": [1, 2], "sampling_params": {"temperature": null}}', "temperature"),
    (b'{"token_ids": [1, 2], "sampling_params": {"seed": "7"}}', "seed"),
    (b'{"token_ids": [1, 2], "sampling_params": {"top_p": 1.5}}', "top_p"),
    (b'{"token_ids": "12"}', "token_ids"),
    (b'{"token_ids": [1, 2], "x": "\xff\xfe"}', "UTF-8"),
    (b'{"token_ids": [1, 2], "request_id": "\\ud800"}', "surrogate"),
    (b"[1, 2]", "JSON object"),
]
BAD_CONTROL = [  # stateful routes: refused before they act
    ("/init_weight_transfer_engine", b"{}", "init_info"),
    ("/init_weight_transfer_engine", b'{"init_info": {}}', "lacks"),
    ("/init_weight_transfer_engine", b'{"init_info": {"master_address": 1}}', "master_address"),
    ("/init_weight_transfer_engine", b'{"init_info": "x"}', "init_info"),
    ("/update_weights", b'{"update_info": []}', "update_info"),
    ("/finish_weight_update", b'{"version": "3"}', "version"),
    ("/finish_weight_update", b'{"version": 1e999}', "finite"),
    ("/pause", b'{"mode": 7}', "mode"),
    ("/pause", b"\xff", "UTF-8"),
    ("/resume", b"{", "JSON"),
    ("/start_weight_update", b"{", "JSON"),
]
BAD_ROUTER_PATHS = ["/v1/../is_paused", "/v1/%2e%2e/is_paused", "/v1/%2E%2E/pause", "/v1/.%2fhealth", "/v1//models"]


@pytest.fixture(scope="module")
def pool(tmp_path_factory, tiny_model_dir):
    run = make_run(tmp_path_factory.mktemp("bad"), "bad", tiny_model_dir, "router.health_interval_s=0.3")
    router, engine = spawn(run, "router"), spawn(run, "engine", 0)
    router, engine = wait_registered(run, router, "router"), wait_registered(run, engine, "engine-0")
    wait_healthy(run, router.url, 1)
    yield run, router, engine
    for p in (router, engine):
        p.stop()


async def post(s, url: str, token: str, body: bytes, headers: dict | None = None) -> tuple[int, dict]:
    hdrs = {"Authorization": f"Bearer {token}", "Content-Type": "application/json", **(headers or {})}
    async with s.post(url, data=body, headers=hdrs) as r:
        return r.status, await r.json(content_type=None)


def message(answer: dict) -> str:
    err = answer["error"]
    return err["message"] if isinstance(err, dict) else err


def test_engine_and_router_refuse_bad_generate_bodies(pool) -> None:
    run, router, engine = pool
    token = run.token()

    async def go():
        out = []
        async with aiohttp.ClientSession() as s:
            for url in (engine.url, router.url):
                for body, needle in BAD_GENERATE:
                    out.append((url, needle, *await post(s, url + GEN, token, body)))
            ok = await post(s, router.url + GEN, token, b'{"token_ids": [1, 2], "sampling_params": {"max_tokens": 2}}')
        return out, ok

    out, ok = arun(go())
    for url, needle, status, answer in out:
        assert status == 400 and needle in message(answer), (url, needle, status, answer)
    assert ok[0] == 200 and len(ok[1]["choices"][0]["token_ids"]) >= 1, "both still serve"


def test_stateful_routes_refuse_invalid_bodies_and_change_nothing(pool) -> None:
    run, _, engine = pool
    token = run.token()

    async def go():
        before = await get_json(engine.url + "/health", run)
        out = []
        async with aiohttp.ClientSession() as s:
            for path, body, needle in BAD_CONTROL:
                out.append((path, needle, *await post(s, engine.url + path, token, body)))
        return before, out, await get_json(engine.url + "/health", run), await get_json(engine.url + "/is_paused", run)

    before, out, after, paused = arun(go())
    for path, needle, status, answer in out:
        assert 400 <= status < 500 and needle in message(answer), (path, needle, status, answer)
    assert after == before and paused == {"is_paused": False}, "a refused request changed the engine"


def test_router_forwards_only_plain_v1_paths_and_valid_session_ids(pool) -> None:
    run, router, _ = pool
    token = run.token()

    async def go():
        out = []
        async with aiohttp.ClientSession() as s:
            for path in BAD_ROUTER_PATHS:
                url = aiohttp.client.URL(router.url + path, encoded=True)
                async with s.get(url, headers={"Authorization": f"Bearer {token}"}) as r:
                    out.append((path, r.status, await r.text()))
            for sid in ("a b", "x" * 200, "../../etc", "é"):
                body = b'{"token_ids": [1, 2], "sampling_params": {"max_tokens": 1}}'
                status, answer = await post(s, router.url + GEN, token, body, {"X-Session-ID": sid})
                out.append((sid, status, message(answer)))
        return out

    for what, status, text in arun(go()):
        assert status == 400, (what, status, text)
        assert "is_paused" not in text or "path" in text, (what, text)


@pytest.fixture(scope="module")
def chat(tiny_model_dir):
    cfg = load_config(None, [])
    server = ChatServer(load_tokenizer(tiny_model_dir), None, cfg.rollout, "tok")
    loop = asyncio.new_event_loop()
    url = loop.run_until_complete(server.start())
    yield loop, url, server
    loop.run_until_complete(server.close())
    loop.close()


BAD_CHAT = [
    (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": "1"}', "temperature"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "top_p": "0.5"}', "top_p"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": 1e999}', "finite"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": Infinity}', "finite"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "seed": "1"}', "seed"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "tools": {"a": 1}}', "tools"),
    (b'{"messages": [{"role": "user", "content": "\xff"}]}', "UTF-8"),
    (b'{"messages": []}', "messages"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "n": 2}', "n = 1"),
]


def test_chat_endpoint_answers_openai_shaped_400s(chat) -> None:
    loop, url, server = chat

    async def go():
        out = []
        async with aiohttp.ClientSession() as s:
            for body, needle in BAD_CHAT:
                out.append((needle, *await post(s, url + "/v1/chat/completions", "tok", body)))
            for session in ("a%0d%0aX-Evil:%201", "a%00b", "x" * 200):
                u = aiohttp.client.URL(f"{url}/s/{session}/v1/chat/completions", encoded=True)
                body = b'{"messages": [{"role": "user", "content": "hi"}]}'
                out.append(("session", *await post(s, u, "tok", body)))
            async with s.get(url + "/v1/models", headers={"Authorization": "Bearer tok"}) as r:
                healthy = r.status
        return out, healthy

    out, healthy = loop.run_until_complete(go())
    for needle, status, answer in out:
        err = answer["error"]
        assert status == 400 and err["type"] == "invalid_request_error", (needle, status, answer)
        assert needle in err["message"], (needle, answer)
        assert "Evil" not in err["message"], "a session id is never echoed"
    assert healthy == 200 and not server.calls, "nothing was recorded"
