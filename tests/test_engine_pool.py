"""The engine pool as real processes: two engines and the router on loopback, refit from a plain sender.

One pool serves every test of this module (engine processes are the expensive part): routing and
affinity first, then the refit, then an engine is killed mid-run and restarted, which exercises the
router's failover and re-admission and the refit group's re-forming together.
"""

import asyncio
import json
import os
import subprocess
import sys
import time
from collections import Counter

import aiohttp
import pytest
import torch

from molt_hpc.config.infra import RefitConfig
from molt_hpc.engine.batch import ModelRunner
from molt_hpc.engine.client import generate, health, pause, resume
from molt_hpc.engine.sampling import processed_logprobs
from molt_hpc.models import load_causal_lm
from molt_hpc.refit import RefitSender
from molt_hpc.router.ring import HashRing
from tests.test_engine_procs import arun, get_json, make_run, spawn, wait_registered

PROMPT = [7, 30, 31, 32, 33, 12]
SESSIONS = [f"rollout-{i}" for i in range(16)]
REFIT = RefitConfig(bucket_mb=1, host="127.0.0.1", backend="gloo")  # the group (test_refit_ipc.py: shared memory)


@pytest.fixture(scope="module")
def pool(tmp_path_factory, tiny_model_dir):
    run = make_run(tmp_path_factory.mktemp("pool"), "pool", tiny_model_dir, "router.health_interval_s=0.3")
    router = spawn(run, "router")
    engines = [spawn(run, "engine", i) for i in range(2)]
    router = wait_registered(run, router, "router")
    engines = [wait_registered(run, p, f"engine-{i}") for i, p in enumerate(engines)]
    wait_healthy(run, router.url, 2)
    yield run, router, engines
    for p in [router, *engines]:
        p.stop()


def wait_healthy(run, router_url: str, n: int, timeout: float = 60) -> dict:
    async def go():
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while loop.time() < deadline:
            metrics = await get_json(router_url + "/metrics", run)
            if metrics["healthy"] == n:
                return metrics
            await asyncio.sleep(0.1)
        raise TimeoutError(f"router never saw {n} healthy engines: {metrics}")

    return arun(go())


async def routed(s, url: str, token: str, session: str | None, sp: dict, prompt=PROMPT) -> tuple[int, dict]:
    """One generate through the router: (index of the engine that served it, the JSON answer)."""
    hdrs = {"Authorization": f"Bearer {token}", **({"X-Session-ID": session} if session else {})}
    async with s.post(
        url + "/inference/v1/generate", headers=hdrs, json={"token_ids": prompt, "sampling_params": sp}
    ) as r:
        assert r.status == 200, await r.text()
        return int(r.headers["X-Molt-Engine"]), await r.json()


def ring_owner(session: str) -> int:
    ring = HashRing(160)
    ring.set_nodes({"engine-0", "engine-1"})
    return int(ring.lookup(session).split("-")[1])


async def turns(s, url: str, token: str) -> dict[str, set[int]]:
    """Three sequential turns of every session (one request in flight: bounded loads never bite)."""
    served: dict[str, set[int]] = {}
    for _ in range(3):
        for sid in SESSIONS:
            engine, _ = await routed(s, url, token, sid, {"max_tokens": 2})
            served.setdefault(sid, set()).add(engine)
    return served


def test_router_keeps_sessions_on_their_engine(pool) -> None:
    run, router, _ = pool
    token = run.token()

    async def go():
        async with aiohttp.ClientSession() as s:
            served = await turns(s, router.url, token)
            sp = {"max_tokens": 30, "ignore_eos": True}
            anonymous = [
                e for e, _ in await asyncio.gather(*[routed(s, router.url, token, None, sp) for _ in range(4)])
            ]
            async with s.get(router.url + "/metrics") as r:
                no_token = r.status
            async with s.post(router.url + "/pause", headers={"Authorization": f"Bearer {token}"}) as r:
                pause = r.status
            return served, anonymous, no_token, pause

    served, anonymous, no_token, pause = arun(go())
    assert all(len(engines) == 1 for engines in served.values()), "every turn of a session hits one engine"
    assert {sid: engines.pop() for sid, engines in served.items()} == {sid: ring_owner(sid) for sid in SESSIONS}
    assert Counter(anonymous) == {0: 2, 1: 2}, "requests without a session go to the least-loaded engine"
    assert no_token == 401 and pause == 404, "the router checks the token and does not route /pause"


def test_bounded_load_spreads_a_hot_session(pool) -> None:
    run, router, _ = pool
    token = run.token()
    n = 12

    async def go():
        async with aiohttp.ClientSession() as s:
            before = await get_json(router.url + "/metrics", run)
            sp = {"max_tokens": 40, "ignore_eos": True}
            out = await asyncio.gather(*[routed(s, router.url, token, "hot", sp) for _ in range(n)])
            return before, out, await get_json(router.url + "/metrics", run)

    before, out, after = arun(go())
    counts = Counter(engine for engine, _ in out)
    assert max(counts.values()) <= -(-5 * n // 8), counts  # ceil(1.25 · n / 2)
    assert counts[ring_owner("hot")] >= n // 2, "the owner still takes its share"
    assert after["in_flight"] == 0 and after["total"] - before["total"] == n


def test_a_client_that_leaves_a_streamed_answer_is_no_failure(pool) -> None:
    """Streamed readers that close after the first event (a rollout closes once it has its answer, before the
    stream's end): the router writes the rest into closed connections and closes its own to the engine, whose
    row is freed; neither logs a failure, and both serve on."""
    run, router, engines = pool
    token = run.token()
    logs = [p.log for p in (router, *engines)]
    logged = [log.stat().st_size for log in logs]
    body = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 60, "ignore_eos": True}, "stream": True}

    async def leave(s) -> bytes:
        hdrs = {"Authorization": f"Bearer {token}"}
        async with s.post(router.url + "/inference/v1/generate", headers=hdrs, json=body) as r:
            assert r.status == 200 and r.content_type == "text/event-stream"
            first = await r.content.readuntil(b"\n\n")
            r.close()  # the connection goes, mid-stream
            return first

    async def go():
        async with aiohttp.ClientSession() as s:
            firsts = await asyncio.gather(*[leave(s) for _ in range(6)])
            quiet = await idle(s)  # every abandoned answer ended: each write into a closed connection happened
            served = await routed(s, router.url, token, None, {"max_tokens": 8, "ignore_eos": True})
            return firsts, quiet, served

    async def idle(s) -> dict:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            metrics = await get_json(router.url + "/metrics", run)
            rows = [await health(s, e.url, token=token) for e in engines]
            if metrics["in_flight"] == 0 and not any(h["running"] or h["waiting"] for h in rows):
                return metrics
            await asyncio.sleep(0.05)
        raise TimeoutError(f"the pool never went idle: {metrics}, {rows}")

    firsts, metrics, (_, answer) = arun(go())
    assert all(f.startswith(b"data:") for f in firsts), firsts
    assert len(answer["choices"][0]["token_ids"]) == 8, answer
    for log, size in zip(logs, logged, strict=True):
        after = log.read_bytes()[size:].decode()
        assert "failed" not in after and "Traceback" not in after, (log.name, after)
    assert metrics["total"] >= 6, metrics


def perturbed(tiny_model_dir, seed: int):
    """The tiny model with every weight moved: what a training step would send."""
    model = load_causal_lm(tiny_model_dir)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return model


def sender_logprobs(model) -> list[float]:
    """Full-vocabulary log-probs after PROMPT, computed the way an engine computes a lone prompt."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the engines run one thread: same kernels, same bits
    try:
        logits, _ = ModelRunner(model, torch.device("cpu")).prefill([PROMPT])
    finally:
        torch.set_num_threads(threads)
    ones = torch.ones(1)
    return processed_logprobs(logits, ones, torch.zeros(1, dtype=torch.long), ones, torch.zeros(1))[0].tolist()


async def engine_logprobs(s, url: str, token: str) -> tuple[list[float], int]:
    body = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 1, "logprobs": -1}}
    async with s.post(url + "/inference/v1/generate", headers={"Authorization": f"Bearer {token}"}, json=body) as r:
        answer = await r.json()
    full = [0.0] * 104
    for entry in answer["choices"][0]["logprobs"]["content"][0]["top_logprobs"]:
        full[entry["token_id"]] = entry["logprob"]
    return full, answer["weight_version"]


def max_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def test_refit_pushes_exact_weights_to_both_engines(pool, tiny_model_dir) -> None:
    """After a push both engines' logits equal the sender's exactly; a request that straddles the push
    reports both versions and each token's log-prob matches the weights that produced it."""
    run, _, engines = pool
    token = run.token()
    old, new = load_causal_lm(tiny_model_dir), perturbed(tiny_model_dir, seed=1)
    sender = RefitSender(run.path, REFIT, token)
    sender.connect([p.url for p in engines])
    assert json.loads((run.rendezvous / "refit_store.json").read_text()) == {
        "host": "127.0.0.1",
        "port": sender.store_port,
    }

    async def go():
        async with aiohttp.ClientSession() as s:
            before = [await engine_logprobs(s, p.url, token) for p in engines]
            sp = {"max_tokens": 300, "ignore_eos": True}
            # Frozen mid-request (tokens of version 0 made), so the push lands inside it however slow it is:
            # held by the paused engine, then run for 5 steps (6 tokens) and frozen again, whatever the timing.
            await pause(s, engines[0].url, token=token, mode="keep")
            long = asyncio.create_task(generate(s, engines[0].url, PROMPT, sp, token=token))
            while (await health(s, engines[0].url, token=token))["waiting"] < 1:
                await asyncio.sleep(0.005)
            await resume(s, engines[0].url, token=token, steps=5)
            while not (frozen := await health(s, engines[0].url, token=token))["paused"]:
                await asyncio.sleep(0.005)
            stats = await asyncio.to_thread(sender.push, new.named_parameters(), 5)
            await resume(s, engines[0].url, token=token)
            # Measured alone: a prompt prefilled in one batch with the re-prefilled frozen row (left-padded to
            # its length) runs other kernel shapes, equal to the lone prompt's log-probs only to rounding.
            straddled = await long
            after = [await engine_logprobs(s, p.url, token) for p in engines]
            assert frozen["running"] == 1
            return before, straddled, stats, after

    before, straddled, stats, after = arun(go())
    want_old, want_new = sender_logprobs(old), sender_logprobs(new)
    assert all(max_diff(lp, want_old) == 0 and v == 0 for lp, v in before)
    assert max_diff(want_old, want_new) > 1e-3, "the push must change the outputs"
    assert all(max_diff(lp, want_new) == 0 and v == 5 for lp, v in after), "exact weights, new version"
    assert stats.buckets >= 2 and stats.engines == 2
    assert json.loads((run.rendezvous / "engine-1.json").read_text())["version"] == 5

    versions = straddled.weight_versions
    cut = versions.index(5)
    assert cut > 0 and set(versions[:cut]) == {0} and set(versions[cut:]) == {5}, versions
    full = PROMPT + straddled.token_ids
    for model, lo, hi in [(old, 0, cut), (new, cut, len(versions))]:
        with torch.no_grad():
            logits = model(torch.tensor([full])).logits[0, len(PROMPT) - 1 : -1][lo:hi]
        want = logits.log_softmax(-1).gather(-1, torch.tensor(straddled.token_ids[lo:hi])[:, None]).view(-1)
        assert (want - torch.tensor(straddled.logprobs[lo:hi])).abs().max() < 1e-5

    # an update the engines cannot load is refused by all of them, and the group stays in step
    with pytest.raises(RuntimeError, match="does not have"):
        sender.push([("model.not_a_layer.weight", torch.zeros(3))], version=6)
    with pytest.raises(ValueError, match="connect"):
        sender.push(old.named_parameters(), version=6)  # a failed push drops the group
    sender.connect([p.url for p in engines])
    sender.push(old.named_parameters(), version=6)
    back = arun(_all_logprobs(engines, token))
    assert all(max_diff(lp, want_old) == 0 and v == 6 for lp, v in back)
    sender.close()


# A trainer stand-in that refits in a loop; it reads the safetensors directly (no transformers import).
SENDER_LOOP = """
import sys
from safetensors.torch import load_file
from molt_hpc.config.infra import RefitConfig
from molt_hpc.refit import RefitSender
run, model_dir, token, *urls = sys.argv[1:]
weights = load_file(model_dir + "/model.safetensors")
sender = RefitSender(run, RefitConfig(bucket_mb=1, host="127.0.0.1", backend="gloo"), token)
sender.connect(urls)
print("pushing", flush=True)
for version in range(100, 100000):
    weights["model.norm.weight"] += 0.01
    sender.push(weights.items(), version)
"""


def test_a_sender_killed_mid_refit_leaves_no_torn_weights(pool, tiny_model_dir) -> None:
    """Wherever the kill lands (between pushes, mid-broadcast), a new sender's push brings every engine
    to exactly its weights; until then no engine serves a half-loaded policy (they wait paused)."""
    run, _, engines = pool
    token = run.token()
    cmd = [sys.executable, "-c", SENDER_LOOP, str(run.path), str(tiny_model_dir), token, *[p.url for p in engines]]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.stdout.readline().strip() == "pushing"
    time.sleep(0.5)
    proc.kill()
    proc.wait()
    newest = perturbed(tiny_model_dir, seed=3)
    sender = RefitSender(run.path, REFIT, token)
    sender.connect([p.url for p in engines])
    sender.push(newest.named_parameters(), version=8)
    want = sender_logprobs(newest)
    assert all(max_diff(lp, want) == 0 and v == 8 for lp, v in arun(_all_logprobs(engines, token)))
    sender.close()


async def _all_logprobs(engines, token: str):
    async with aiohttp.ClientSession() as s:
        return [await engine_logprobs(s, p.url, token) for p in engines]


def test_engine_killed_mid_run_fails_over_rejoins_and_refits(pool, tiny_model_dir) -> None:
    run, router, engines = pool
    token = run.token()

    async def storm_and_kill():
        async with aiohttp.ClientSession() as s:
            sp = {"max_tokens": 120, "ignore_eos": True}
            for e in engines:  # hold every request where the router sends it: the kill finds some in flight
                await pause(s, e.url, token=token, mode="keep")
            tasks = [asyncio.create_task(routed(s, router.url, token, sid, sp)) for sid in SESSIONS]
            deadline = time.monotonic() + 120
            while sum([(await health(s, e.url, token=token))["waiting"] for e in engines]) < len(SESSIONS):
                ended = [t for t in tasks if t.done()]  # a request the router answered without an engine
                if ended or time.monotonic() > deadline:
                    held = [await health(s, e.url, token=token) for e in engines]
                    metrics = await get_json(router.url + "/metrics", run)
                    raise AssertionError(f"not every request held: {held}, {metrics}, {[t.exception() for t in ended]}")
                await asyncio.sleep(0.005)
            engines[1].kill()
            await resume(s, engines[0].url, token=token)
            results = await asyncio.gather(*tasks)
            metrics = await get_json(router.url + "/metrics", run)
            return results, metrics, await turns(s, router.url, token)

    results, metrics, during = arun(storm_and_kill())
    assert all(len(answer["choices"][0]["token_ids"]) == 120 for _, answer in results), "no request was lost"
    assert metrics["retries"] >= 1 and [e["healthy"] for e in metrics["engines"]] == [True, False]
    assert all(engines == {0} for engines in during.values()), "engine 0 takes every session meanwhile"

    engines[1] = wait_registered(run, spawn(run, "engine", 1), "engine-1")  # restarted on a new port
    ring_version = metrics["engines"][0]["version"]

    async def left_waiting():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # it answers, but on older weights than the ring's: kept out until a refit
            seen = (await get_json(router.url + "/metrics", run))["engines"][1]
            if seen["waiting"]:
                return seen
            await asyncio.sleep(0.05)
        raise AssertionError(f"the restarted engine was never seen waiting for a refit: {seen}")

    seen = arun(left_waiting())
    assert not seen["healthy"] and seen["version"] == 0 < ring_version

    newer = perturbed(tiny_model_dir, seed=2)
    sender = RefitSender(run.path, REFIT, token)
    sender.connect([p.url for p in engines])
    sender.push(newer.named_parameters(), version=ring_version + 1)
    want = sender_logprobs(newer)
    assert all(max_diff(lp, want) == 0 and v == ring_version + 1 for lp, v in arun(_all_logprobs(engines, token)))
    sender.close()
    wait_healthy(run, router.url, 2)  # refitted to the ring's version: it joins

    async def back():
        async with aiohttp.ClientSession() as s:
            return await turns(s, router.url, token)

    after = arun(back())
    # only the dead engine's sessions moved, and they return to it: ring nodes are engine indices
    assert {sid: e.pop() for sid, e in after.items()} == {sid: ring_owner(sid) for sid in SESSIONS}
