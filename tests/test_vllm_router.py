"""`router.kind = "vllm-router"`: vLLM's Rust router started and watched by our router process, real engines."""

import contextlib
import json
import socket
import subprocess
import time
import urllib.error
import urllib.request

import pytest

from molt_hpc.router.vllm_router import Supervisor, command
from tests.test_rollout_procs import Pool, base_overrides, make_run, spawn, wait_file

pytest.importorskip("vllm_router")
pytestmark = pytest.mark.timeout(300)


def generate(url: str, token: str | None, session: str) -> tuple[int, dict]:
    body = json.dumps({"token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 2, "temperature": 0.0}})
    headers = {"Content-Type": "application/json", "X-Session-ID": session}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url + "/inference/v1/generate", data=body.encode(), headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, {}


def served(url: str, token: str, session: str) -> bool:
    """Whether the router answers a generate for `session`; refused while vllm-router restarts (its port
    is closed from the old child's exit until the new one listens)."""
    try:
        return generate(url, token, session)[0] == 200
    except urllib.error.URLError:
        return False


def engine_of(answer: dict) -> int:
    return int(answer["id"].split("-")[1])  # the built-in engine names its answers gen-<index>-<n>


def wait_until(condition, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.2)
    return value


@pytest.fixture(scope="module")
def pool(tmp_path_factory, tiny_model_dir):
    """One pool for the module; the tests run in file order and the last one stops its router."""
    run, cfg = make_run(
        tmp_path_factory.mktemp("vllm-router"), "pool", [*base_overrides(tiny_model_dir), "router.kind=vllm-router"]
    )
    pool = Pool(run, cfg)
    pool.engines = [pool.start_engine(i) for i in range(2)]
    for i, p in enumerate(pool.engines):
        wait_file(run.rendezvous / f"engine-{i}.json", [p], pid=p.proc.pid)
    pool.router = spawn("engine.py", [str(run.path), "--role", "router"], run.logs / "router.log")
    try:
        wait_file(run.rendezvous / "router.json", [pool.router])
        yield pool
    finally:
        pool.stop()


def test_engines_answer_a_tokenless_health_check_with_liveness_only(pool) -> None:
    url = pool.engine_url(0)
    with urllib.request.urlopen(url + "/health", timeout=10) as resp:
        assert json.loads(resp.read()) == {"status": "ok"}  # no scheduler state without the token
    with urllib.request.urlopen(urllib.request.Request(url + "/health", headers=pool.run.auth_headers())) as resp:
        assert "index" in json.loads(resp.read())
    with pytest.raises(urllib.error.HTTPError, match="401"):
        urllib.request.urlopen(url + "/v1/models", timeout=10)
    assert pool.run.token() not in " ".join(command(pool.cfg, 1234, ["http://127.0.0.1:1"], 1235))


def test_sessions_stick_tokens_are_checked_and_a_restarted_engine_is_followed(pool) -> None:
    url, token = json.loads((pool.run.rendezvous / "router.json").read_text())["url"], pool.run.token()
    # the router file is written once vllm-router serves; it may start with the engines that answered by then
    # and restart with both: sessions sent before that would be spread over one engine only
    wait_until(lambda: routes_to_the_engines(pool) and served(url, token, "warm-up"))
    firsts = {}
    for s in range(64):  # sessions until both engines have some (8 at least): 64 on one engine has odds 2^-63
        status, answer = generate(url, token, f"session-{s}")
        assert status == 200 and len(answer["choices"][0]["token_ids"]) == 2
        firsts[s] = engine_of(answer)
        if s >= 7 and len(set(firsts.values())) == 2:
            break
    assert set(firsts.values()) == {0, 1}, firsts
    for s, engine in firsts.items():  # every later turn of a session reaches the same engine
        assert engine_of(generate(url, token, f"session-{s}")[1]) == engine
    assert generate(url, None, "session-0")[0] == 401  # the engines still refuse a request without the token
    assert generate(url, "wrong", "session-0")[0] == 401

    old = pool.engine_url(0)
    pool.engines[0].stop()
    pool.engines[0] = pool.start_engine(0)  # back on a new port, as the pool restarts engines
    wait_file(pool.run.rendezvous / "engine-0.json", [pool.engines[0]], pid=pool.engines[0].proc.pid)
    assert pool.engine_url(0) != old
    wait_until(lambda: routes_to_the_engines(pool))  # (the first restart drops engine 0, a second adds it back)
    answers = [wait_until(lambda s=s: served(url, token, f"session-{s}")) for s in firsts]
    assert all(answers)  # every session is served again, on the same router address


def routes_to_the_engines(pool) -> bool:
    """Whether the supervisor's last started child routes to the engines registered now (a worker added
    to a child it is about to replace would vanish with it)."""
    started = [line for line in (pool.run.logs / "router.log").read_text().splitlines() if " routes to " in line]
    return bool(started) and started[-1].endswith(" routes to " + ", ".join(pool.engine_url(i) for i in range(2)))


def test_a_worker_added_behind_the_run_stops_the_router(pool) -> None:
    url = json.loads((pool.run.rendezvous / "router.json").read_text())["url"]
    wait_until(lambda: routes_to_the_engines(pool) and served(url, pool.run.token(), "session-0"))
    stranger = pool.engine_url(1).replace("http://127.0.0.1:", "http://localhost:")  # same server, foreign name
    req = urllib.request.Request(f"{url}/add_worker?url={stranger}", method="POST")
    with contextlib.suppress(OSError):  # vLLM's router takes this without any token (it may answer late)
        urllib.request.urlopen(req, timeout=30).close()
    assert pool.router.proc.wait(timeout=60) == 1
    assert "not engines of this run" in (pool.run.logs / "router.log").read_text()


def test_two_routers_on_one_machine_both_run(pool) -> None:
    """vllm-router's Prometheus exporter cannot be turned off and took port 29000 in every router, so a second
    router on the machine (another run, a test beside this one) died at start: each now has its own port."""
    sups = [Supervisor(pool.cfg, pool.run) for _ in range(2)]
    assert sups[0].metrics_port != sups[1].metrics_port
    procs = [subprocess.Popen(command(s.cfg, s.port, ["http://127.0.0.1:1"], s.metrics_port),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for s in sups]  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        for s, proc in zip(sups, procs, strict=True):  # up once its exporter listens (it binds first)
            while True:
                assert proc.poll() is None, f"a router died at start with code {proc.returncode}"
                with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", s.metrics_port), 1):
                    break
                assert time.monotonic() < deadline, "a router's exporter never listened"
                time.sleep(0.1)
        assert [p.poll() for p in procs] == [None, None]
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait()
