"""Bad input at every server's edge: a 4xx with its reason, nothing changed, the server still healthy.

Real processes on loopback: an engine, the router and the scorer (`jobs/engine.py`), the chat endpoint
and a vLLM front on real aiohttp servers (the front before a recording stand-in for `vllm serve`, which
shows that nothing refused was forwarded). Each class of bad input (wrong types, nulls, non-finite
numbers, bad encodings, traversal and control characters in paths, oversize bodies, stateful routes
with invalid bodies) is sent as raw bytes.
"""

import asyncio
import json

import aiohttp
import pytest
from aiohttp import web
from yarl import URL

from molt_hpc.config import load_config
from molt_hpc.engine.vllm.front import Front, build_front
from molt_hpc.models import load_tokenizer
from molt_hpc.refit import RefitSender
from molt_hpc.rollout.chat_server import ChatServer
from tests.test_engine_pool import REFIT, engine_logprobs, max_diff, perturbed, sender_logprobs, wait_healthy
from tests.test_engine_procs import arun, get_json, make_run, spawn, wait_registered
from tests.test_scorer import build_reward_dir

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
    ("/resume", b'{"steps": 0}', "steps"),
    ("/resume", b'{"steps": "3"}', "steps"),
    ("/resume", b'{"now": true}', "now"),
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


async def oversize(url: str, path: str, token: str) -> tuple[int, dict]:
    """A POST that declares a 1 TiB body and sends one byte of it: refused from its headers (413)."""
    u = URL(url)
    reader, writer = await asyncio.open_connection(u.host, u.port)
    head = f"POST {path} HTTP/1.1\r\nHost: {u.host}\r\nAuthorization: Bearer {token}\r\n"
    writer.write(f"{head}Content-Type: application/json\r\nContent-Length: {1 << 40}\r\n\r\n{{".encode())
    await writer.drain()
    status = int((await reader.readline()).split()[1])
    length = 0
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        length = int(value) if name.lower() == "content-length" else length
    body = json.loads(await reader.readexactly(length))
    writer.close()
    return status, body


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
                out.append((url, "limit", *await oversize(url, GEN, token)))
            ok = await post(s, router.url + GEN, token, b'{"token_ids": [1, 2], "sampling_params": {"max_tokens": 2}}')
        return out, ok

    out, ok = arun(go())
    for url, needle, status, answer in out:
        assert status == (413 if needle == "limit" else 400) and needle in message(answer), (url, needle, answer)
    assert ok[0] == 200 and len(ok[1]["choices"][0]["token_ids"]) >= 1, "both still serve"


def test_stateful_routes_refuse_invalid_bodies_and_change_nothing(pool) -> None:
    run, _, engine = pool
    token = run.token()

    async def go():
        # The previous test's last request was answered, so the engine shows no row: it answers a request only
        # once the row is gone from its counts (`Scheduler._settle`).
        before = await get_json(engine.url + "/health", run)
        out = []
        async with aiohttp.ClientSession() as s:
            for path, body, needle in BAD_CONTROL:
                out.append((path, needle, *await post(s, engine.url + path, token, body)))
            for path in ("/init_weight_transfer_engine", "/update_weights", "/pause"):
                out.append((path, "limit", *await oversize(engine.url, path, token)))
        return before, out, await get_json(engine.url + "/health", run), await get_json(engine.url + "/is_paused", run)

    before, out, after, paused = arun(go())
    for path, needle, status, answer in out:
        assert 400 <= status < 500 and needle in message(answer), (path, needle, status, answer)
    assert before["running"] == before["waiting"] == 0, before
    assert after == before and paused == {"is_paused": False}, "a refused request changed the engine"


BAD_INIT = [  # each refused (400) while a refit group is live: the engine must keep its channel
    b"{}",
    b'{"init_info": {}}',
    b'{"init_info": null}',
    b'{"init_info": {"backend": "gloo", "master_address": "127.0.0.1", "master_port": 0, "rank_offset": 1, '
    b'"world_size": 2}}',
    b'{"init_info": {"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 2, "world_size": 2}}',
]


def test_a_refused_refit_init_leaves_the_live_refit_channel_working(pool, tiny_model_dir) -> None:
    """Refit (version 1), refused inits, refit again: version 2 is served with exactly its weights."""
    run, _, engine = pool
    token = run.token()
    first, second = perturbed(tiny_model_dir, seed=11), perturbed(tiny_model_dir, seed=12)
    sender = RefitSender(run.path, REFIT, token)
    sender.connect([engine.url])
    sender.push(first.named_parameters(), version=1)

    async def refuse():
        async with aiohttp.ClientSession() as s:
            served = await engine_logprobs(s, engine.url, token)
            url = engine.url + "/init_weight_transfer_engine"
            return served, [await post(s, url, token, body) for body in BAD_INIT]

    served, refused = arun(refuse())
    sender.push(second.named_parameters(), version=2)  # over the same group: it was not dropped
    after = arun(_logprobs(engine.url, token))
    sender.close()
    assert [status for status, _ in refused] == [400] * len(BAD_INIT), refused
    want_first, want_second = sender_logprobs(first), sender_logprobs(second)
    assert max_diff(want_first, want_second) > 1e-3, "the second refit must change the outputs"
    assert served[1] == 1 and max_diff(served[0], want_first) == 0
    assert after[1] == 2 and max_diff(after[0], want_second) == 0, "version 2 with exactly its weights"


async def _logprobs(url: str, token: str) -> tuple[list[float], int]:
    async with aiohttp.ClientSession() as s:
        return await engine_logprobs(s, url, token)


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
    (b'{"messages": [{"role": "user", "content": "hi"}], "n": 129}', "n"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "n": 0}', "n"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 21, "logprobs": true}', "top_logprobs"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "presence_penalty": 0.5}', "presence_penalty"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}', "logprobs = true"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "stream": 1}', "stream"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "stream_options": {"include_usage": "y"}}', "include_usage"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"}', "tool_choice needs tools"),
    (b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}', "text parts"),
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
            out.append(("limit", *await oversize(url, "/v1/chat/completions", "tok")))
            async with s.get(url + "/v1/models", headers={"Authorization": "Bearer tok"}) as r:
                healthy = r.status
        return out, healthy

    out, healthy = loop.run_until_complete(go())
    for needle, status, answer in out:
        err = answer["error"]
        assert status == (413 if needle == "limit" else 400), (needle, status, answer)
        assert err["type"] == "invalid_request_error", (needle, answer)
        assert needle in err["message"], (needle, answer)
        assert "Evil" not in err["message"], "a session id is never echoed"
    assert healthy == 200 and not server.calls, "nothing was recorded"


BAD_CLASSIFY = [
    (b'{"input": "12"}', "input"),
    (b'{"input": [[1, "2"]]}', "input"),
    (b'{"input": [[1, 2.5]]}', "input"),
    (b'{"input": [[1, true]]}', "input"),
    (b'{"input": null}', "input"),
    (b'{"input": [null]}', "input"),
    (b'{"input": []}', "input"),
    (b'{"input": [[]]}', "input[0]"),
    (b'{"input": [[1, 2]], "use_activation": "yes"}', "use_activation"),
    (b'{"input": [[1, 2]], "use_activation": null, "x": 1}', "x"),
    (b'{"input": [[1, 1e999]]}', "finite"),
    (b'{"input": [[1, NaN]]}', "finite"),
    (b'{"input": [[1, 2]], "model": "\xff"}', "UTF-8"),
    (b'{"input": [[1, 2]], "model": "\\udfff"}', "surrogate"),
    (b'{"input": [[1, 99999999999999999999999]]}', "vocabulary"),
    (b'{"input": [[1, -1]]}', "vocabulary"),
]


@pytest.fixture(scope="module")
def scorer(tmp_path_factory, tiny_model_dir):
    rm = build_reward_dir(tmp_path_factory.mktemp("rm"), tiny_model_dir)
    run = make_run(
        tmp_path_factory.mktemp("badrm"), "badrm", tiny_model_dir, f"reward_model.path={json.dumps(str(rm))}"
    )
    p = wait_registered(run, spawn(run, "scorer"), "scorer-0")
    yield run, p
    p.stop()


def test_scorer_refuses_bad_classify_bodies_and_paths(scorer) -> None:
    run, p = scorer
    token = run.token()

    async def go():
        out = []
        async with aiohttp.ClientSession() as s:
            good = await post(s, p.url + "/classify", token, b'{"input": [[2, 30, 3]]}')
            for body, needle in BAD_CLASSIFY:
                out.append((needle, *await post(s, p.url + "/classify", token, body)))
            out.append(("limit", *await oversize(p.url, "/classify", token)))
            paths = []
            for path in (
                "/classify/..",
                "/classify/%2e%2e/health",
                "/%2e%2e/classify",
                "/classify%00",
                "/x/../../classify",
            ):
                async with s.post(URL(p.url + path, encoded=True), data=b'{"input": [[2, 3]]}',
                                  headers={"Authorization": f"Bearer {token}"}) as r:  # fmt: skip
                    paths.append((path, r.status))
            again = await post(s, p.url + "/classify", token, b'{"input": [[2, 30, 3]]}')
            return good, out, paths, again, await get_json(p.url + "/health", run)

    good, out, paths, again, health = arun(go())
    for needle, status, answer in out:
        assert status == (413 if needle == "limit" else 400) and needle in message(answer), (needle, status, answer)
    for path, status in paths:
        assert 400 <= status < 500, (path, status)
    assert good[0] == 200 and again == good, "the scorer still scores, and the same"
    assert health["status"] == "ok"


BAD_FRONT = [  # (path, body, reason): refused at the front, never forwarded to vLLM
    *((GEN, body, needle) for body, needle in BAD_GENERATE),
    (GEN, b'{"token_ids": [1, 2], "sampling_params": {"n": 2}, "stream": true}', "n = 1"),
    (GEN, b'{"token_ids": [1, 2], "mm": [1]}', "mm"),
    *BAD_CONTROL,
    ("/init_weight_transfer_engine", b'{"init_info": {"backend": "ipc"}}', "ipc"),
    ("/init_weight_transfer_engine", b'{"init_info": null}', "init_info"),
    ("/resume", b'{"steps": 3}', "vLLM"),  # a built-in engine's control only: refused, never relayed
    ("/collective_rpc", b'{"method": 5}', "method"),
    ("/collective_rpc", b'{"method": "molt_place", "timeout": Infinity}', "finite"),
    ("/collective_rpc", b'{"method": "molt_place", "args": null}', "args"),
    ("/collective_rpc", b'{"method": "load_model"}', "molt_"),
    ("/is_paused", b"\xff", "UTF-8"),
    ("/v1/models", b'{"a": NaN}', "finite"),
]


@pytest.fixture(scope="module")
def front():
    """A vLLM front before a stand-in `vllm serve` that answers every call and records all but `/health`."""
    seen: list[tuple[str, str]] = []

    async def upstream(request: web.Request) -> web.Response:
        if request.path != "/health":
            seen.append((request.method, request.path_qs))
        if request.path == GEN:
            return web.json_response({"choices": [{"token_ids": [5], "logprobs": {"content": []}}]})
        return web.json_response({})

    async def start(app: web.Application) -> tuple[web.AppRunner, str]:
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"

    loop = asyncio.new_event_loop()
    vllm = web.Application()
    vllm.router.add_route("*", "/{tail:.*}", upstream)
    up, up_url = loop.run_until_complete(start(vllm))
    runner, url = loop.run_until_complete(start(build_front(Front(up_url, "tok", 0))))
    yield loop, url, seen
    for r in (runner, up):
        loop.run_until_complete(r.cleanup())
    loop.close()


def test_vllm_front_refuses_bad_input_at_the_edge_and_forwards_nothing(front) -> None:
    loop, url, seen = front

    async def go():
        out = []
        async with aiohttp.ClientSession() as s:
            for path, body, needle in BAD_FRONT:
                out.append((path, needle, *await post(s, url + path, "tok", body)))
            for path in ("/pause", "/update_weights", "/init_weight_transfer_engine", GEN):
                out.append((path, "limit", *await oversize(url, path, "tok")))
            for path in [*BAD_ROUTER_PATHS, "/v1/a%00b", "/v1/a%5c..%5cpause"]:
                u = URL(url + path, encoded=True)
                out.append((path, "path", *await post(s, u, "tok", b"{}")))
            refused = list(seen)
            async with s.get(url + "/health", headers={"Authorization": "Bearer tok"}) as r:
                health = (r.status, await r.json())
            ok = await post(s, url + GEN, "tok", b'{"token_ids": [1, 2], "sampling_params": {"max_tokens": 1}}')
        return out, refused, health, ok

    out, refused, health, ok = loop.run_until_complete(go())
    for path, needle, status, answer in out:
        want = 413 if needle == "limit" else 403 if needle == "molt_" else 400
        assert status == want and needle in message(answer), (path, needle, status, answer)
    assert refused == [], "a refused request reached vLLM"
    assert health == (200, {"status": "ok", "index": 0, "kind": "vllm", "weight_version": 0}), "no version changed"
    assert ok[0] == 200 and ok[1]["weight_version"] == 0 and seen == [("POST", GEN)], "a valid one is forwarded"
