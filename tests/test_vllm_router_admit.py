"""Which engines the `vllm-router` supervisor gives vLLM's router: the ones it routes to already, and a new
one once it answers and serves the newest weight version any engine serves. Real HTTP servers on loopback
answer `/health` as the engines do (the version only with the run's token)."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest

from molt_hpc.net import free_port
from molt_hpc.router.vllm_router import admitted, served_versions

TOKEN = "run-token"


class Health(BaseHTTPRequestHandler):
    version: ClassVar[dict[int, int | None]] = {}  # port -> the weight version that engine serves (None: says none)

    def do_GET(self) -> None:
        if self.headers.get("Authorization") != f"Bearer {TOKEN}":
            body, status = {"status": "ok"}, 200  # liveness only, as engines answer vLLM's tokenless check
        else:
            version = Health.version[self.server.server_address[1]]
            body = {"status": "ok"} if version is None else {"status": "ok", "weight_version": version}
            status = 200
        raw = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def engines():
    servers = [ThreadingHTTPServer(("127.0.0.1", 0), Health) for _ in range(4)]
    for server in servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    yield [f"http://127.0.0.1:{s.server_address[1]}" for s in servers], [s.server_address[1] for s in servers]
    for server in servers:
        server.shutdown()
        server.server_close()


def test_a_new_engine_waits_for_the_newest_version_and_routed_ones_stay(engines) -> None:
    urls, ports = engines
    a, b, c, d = urls
    Health.version.update({ports[0]: 3, ports[1]: 3, ports[2]: 0, ports[3]: None})
    versions = served_versions(urls, TOKEN)
    assert versions == {a: 3, b: 3, c: 0, d: None}
    assert admitted([a, b, c], [a, b], versions) == [a, b]  # c joined on older weights: not yet
    Health.version[ports[2]] = 3  # the trainer's refit reached it
    assert admitted([a, b, c], [a, b], served_versions([a, b, c], TOKEN)) == [a, b, c]
    Health.version[ports[0]] = 4  # a refit in progress: b is still on 3, and stays routed to
    assert admitted([a, b, c], [a, b, c], served_versions([a, b, c], TOKEN)) == [a, b, c]
    assert admitted([a, d], [a], served_versions([a, d], TOKEN)) == [a, d]  # it answers but names no version
    assert served_versions([a], "wrong") == {a: None}  # without the token an engine says nothing of its weights


def test_an_engine_that_does_not_answer_is_not_added(engines) -> None:
    urls, ports = engines
    Health.version.update(dict.fromkeys(ports, 0))
    gone = f"http://127.0.0.1:{free_port('127.0.0.1')}"  # nothing listens there
    versions = served_versions([urls[0], gone], TOKEN)
    assert versions == {urls[0]: 0}
    assert admitted([urls[0], gone], [urls[0]], versions) == [urls[0]]
    assert admitted([urls[0], gone], [urls[0], gone], versions) == [
        urls[0],
        gone,
    ]  # routed already: vllm-router's checks decide
