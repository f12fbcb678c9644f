"""The refit's HTTP calls (`refit/calls.py`) against a real aiohttp server on loopback: each thread keeps
its connection to an engine alive between calls, opens a new one when the server closed the old one
(its idle timeout), and an error answer or a refused connection raises with the engine's words."""

import asyncio
import threading
import time

import pytest
from aiohttp import web

from molt_hpc.net import free_port
from molt_hpc.refit import calls
from molt_hpc.refit.calls import EngineCalls, get_json, post_json

TOKEN = "t0ken"
IDLE_S = 0.3


@pytest.fixture
def server():
    """A server that answers who called (the client's port) and closes connections idle for IDLE_S."""
    peers: list[int] = []

    async def echo(request: web.Request) -> web.Response:
        if request.headers.get("Authorization") != f"Bearer {TOKEN}":
            return web.json_response({"error": "bad token"}, status=401)
        peers.append(request.transport.get_extra_info("peername")[1])
        body = await request.json() if request.can_read_body else None
        return web.json_response({"port": peers[-1], "body": body})

    async def refuse(request: web.Request) -> web.Response:
        return web.json_response({"error": "call /start_weight_update first"}, status=409)

    loop = asyncio.new_event_loop()
    app = web.Application()
    app.add_routes([web.post("/echo", echo), web.get("/echo", echo), web.post("/refuse", refuse)])
    runner = web.AppRunner(app, keepalive_timeout=IDLE_S)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = site._server.sockets[0].getsockname()[1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{port}", peers
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def test_calls_keep_their_connection_and_reopen_it_after_the_server_closed_it(server) -> None:
    url, peers = server
    first = post_json(f"{url}/echo", {"n": 1}, TOKEN, 10)
    second = get_json(f"{url}/echo?x=1", TOKEN, 10)
    assert first["body"] == {"n": 1} and second["body"] is None
    assert first["port"] == second["port"], "the second call reused the first one's connection"
    conn = calls._local.conns[url.removeprefix("http://")]
    deadline = time.monotonic() + 30
    while not calls._readable(conn.sock):  # the server closes it after IDLE_S of silence
        assert time.monotonic() < deadline, "the server never closed the idle connection"
        time.sleep(0.05)
    third = post_json(f"{url}/echo", {"n": 3}, TOKEN, 10)
    assert third["body"] == {"n": 3} and third["port"] != first["port"], "a new connection, not an error"
    assert len(peers) == 3


def test_error_answers_and_refused_connections_raise_with_the_reason(server) -> None:
    url, _ = server
    with pytest.raises(RuntimeError, match=r"HTTP 409: .*start_weight_update first"):
        post_json(f"{url}/refuse", {}, TOKEN, 10)
    with pytest.raises(RuntimeError, match="HTTP 401"):
        post_json(f"{url}/echo", {}, "wrong", 10)
    assert post_json(f"{url}/echo", {"n": 4}, TOKEN, 10)["body"] == {"n": 4}, "the connection survives an error"
    with pytest.raises(OSError):
        post_json(f"http://127.0.0.1:{free_port()}/echo", {}, TOKEN, 10)


def test_a_round_names_every_engine_that_failed(server) -> None:
    url, _ = server
    engine_calls = EngineCalls(TOKEN, 10)
    try:
        answers = engine_calls.round([url, url], "/echo", {"n": 5})
        assert [a["body"] for a in answers] == [{"n": 5}, {"n": 5}]
        dead = f"http://127.0.0.1:{free_port()}"
        with pytest.raises(RuntimeError, match=r"refuse failed on 2 engine\(s\)") as err:
            engine_calls.round([url, dead], "/refuse")
        assert url in str(err.value) and dead in str(err.value)
    finally:
        engine_calls.close()
