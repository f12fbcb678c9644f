"""`molt-hpc engines add --local / list / remove` against a live run (the shared pool's engines and router).

A pool added from the command line registers, joins the router's ring and serves; removed while a
request it holds is in flight, that request continues on the run's other engines from its tokens.
Bad input is refused in one line with exit code 2 before anything starts, the run untouched.
"""

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

from molt_hpc.cli import main
from molt_hpc.config.rollout import RouterConfig
from molt_hpc.engine import client
from molt_hpc.launch import pools
from molt_hpc.models import load_causal_lm
from molt_hpc.router.pool import Engine, EnginePool, admits
from molt_hpc.router.ring import HashRing
from molt_hpc.rundir import RunDir
from tests.rollout_support import NO_STOP, freeze_mid_answer, teacher_forced, wait_until, with_link
from tests.test_rollout_procs import ROOT, router_metrics, shared_pool

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def pool(tmp_path_factory, tiny_model_dir):
    return shared_pool(tmp_path_factory.mktemp("pool"), tiny_model_dir)


def cli(*args: str) -> subprocess.CompletedProcess:
    """The real command, in its own process (an added pool outlives it, as it does for a user)."""
    cmd = [sys.executable, "-c", "from molt_hpc.cli import main; main()", *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=240)


def snapshot(run: RunDir) -> dict:
    return {p.name: p.read_bytes() for p in sorted(run.rendezvous.iterdir())}


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--kind", "vllm"], "refits engines.kind = 'builtin' engines only"),
        (["--set", "model.path=builtin:tiny-moe"], "differs from the run's"),
    ],
)
def test_a_pool_the_run_cannot_take_is_refused_and_nothing_changes(pool, args, says) -> None:
    before = snapshot(pool.run)
    result = CliRunner().invoke(main, ["engines", "add", str(pool.run.path), "--local", *args])
    assert result.exit_code == 2 and says in result.output and result.output.count("\n") == 1, result.output
    assert snapshot(pool.run) == before and not pools.pools_dir(pool.run).exists()


def test_a_run_that_is_not_live_or_whose_token_differs_is_refused(pool, tmp_path) -> None:
    dead = tmp_path / "dead"
    (dead / "rendezvous").mkdir(parents=True)
    shutil.copy(pool.run.config, dead / "config.toml")
    (dead / "rendezvous" / "token").write_text("another-token")
    result = CliRunner().invoke(main, ["engines", "add", str(dead), "--local"])
    assert result.exit_code == 2 and "is not live (no router registered)" in result.output
    shutil.copy(pool.run.rendezvous / "router.json", dead / "rendezvous" / "router.json")  # the live router
    result = CliRunner().invoke(main, ["engines", "add", str(dead), "--local"])
    assert result.exit_code == 2 and "refuses the run's token" in result.output
    assert not (dead / "pools").exists() and sorted(p.name for p in (dead / "rendezvous").iterdir()) == [
        "router.json",
        "token",
    ]


def test_an_engine_joins_the_ring_only_at_the_ring_version() -> None:
    assert admits(3, 3) and admits(4, 3) and not admits(2, 3)
    assert admits(0, None) and admits(None, 5)  # an empty ring takes anyone; a version nobody reports is no bar


def test_a_resumed_run_keeps_the_pools_that_run_and_forgets_the_others(tmp_path) -> None:
    run = RunDir(tmp_path / "run")
    (run.path / "rendezvous").mkdir(parents=True)
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    live = pools.PoolRecord("pool-1", "local", "builtin", [1000, 1001], state="serving", pid=ended.pid)
    here = pools.PoolRecord("pool-2", "local", "builtin", [2000], state="serving", pid=os.getpid())
    gone = pools.PoolRecord("pool-3", "local", "builtin", [3000], state="removed")
    for rec in (live, here, gone):
        pools.save(run, rec)
        for i in rec.indices:
            (run.rendezvous / f"engine-{i}.json").write_text("{}")
    assert [r.name for r in pools.reconcile(run)] == ["pool-2"]
    states = {r.name: r.state for r in pools.records(run)}
    assert states == {"pool-1": "ended", "pool-2": "serving", "pool-3": "removed"}
    left = sorted(p.name for p in run.rendezvous.iterdir())
    assert left == ["engine-2000.json", "engine-3000.json"]  # only the ended pool's registrations went
    assert pools.next_pool(run) == ("pool-4", 4000)


def session_on(node: str, nodes: set[str], virtual_nodes: int) -> str:
    """A session id the router's ring gives to `node` (with nothing else in flight, bounded loads agree)."""
    ring = HashRing(virtual_nodes)
    ring.set_nodes(nodes)
    return next(s for s in (f"join-{i}" for i in range(10_000)) if ring.lookup(s) == node)


def test_a_local_pool_joins_serves_and_leaves_without_losing_a_token(pool, tiny_model_dir) -> None:
    added = cli("engines", "add", str(pool.run.path), "--local", "--count", "1")
    assert added.returncode == 0, added.stderr
    (record,) = pools.records(pool.run)
    assert record.state == "serving" and record.indices == [1000] and pools.pid_alive(record.pid)
    url = json.loads((pool.run.rendezvous / "engine-1000.json").read_text())["url"]

    async def go(link):
        await wait_until(lambda: _in_ring(pool, 1000))
        nodes = {f"engine-{e['index']}" for e in router_metrics(pool)["engines"] if e["healthy"]}
        session = session_on("engine-1000", nodes, pool.cfg.router.virtual_nodes)
        params = {"max_tokens": 200, "temperature": 1.0, "seed": 3, **NO_STOP}
        task, kept = await freeze_mid_answer(link, url, session, lambda: link.generate([1, 2, 3, 4], params, session))
        removed = await asyncio.to_thread(cli, "engines", "remove", str(pool.run.path), "pool-1", "--drain-s", "0")
        return await task, kept, removed, link.take_counts()

    listed = cli("engines", "list", str(pool.run.path))
    assert listed.returncode == 0 and "pool-1" in listed.stdout and "serving" in listed.stdout, listed.stdout
    status = cli("status", str(pool.run.path))
    line = next(x for x in status.stdout.splitlines() if x.startswith("pool pool-1"))
    assert line.startswith(f"pool pool-1 (local, pid {record.pid}): 1 engine(s), ") and line.endswith("serving")
    out, kept, removed, counts = with_link(pool, go)
    assert removed.returncode == 0 and "pool-1: removed" in removed.stdout, removed.stderr
    assert len(out.token_ids) == 200 and out.token_ids[: len(kept)] == kept and len(kept) == 12
    assert counts["requests_migrated"] == 1 and counts["tokens_migrated"] >= len(kept)
    model = load_causal_lm(tiny_model_dir)
    forced = teacher_forced(model, [1, 2, 3, 4, *out.token_ids])[3:]  # both engines' tokens: exact log-probs
    assert torch.allclose(forced, torch.tensor(out.logprobs, dtype=torch.float64), atol=1e-4)
    (record,) = pools.records(pool.run)
    assert record.state == "removed" and not pools.pid_alive(record.pid)
    assert not (pool.run.rendezvous / "engine-1000.json").exists()
    assert "removed" in cli("engines", "list", str(pool.run.path)).stdout


def test_a_pool_given_slurms_warning_leaves_the_ring_and_finishes_what_it_holds(pool) -> None:
    """Slurm's warning reaches every process of a pool's job step: the supervisor takes the pool out of the
    ring, and its engine (started with the signal blocked) lives on and finishes the request it holds there."""
    added = cli("engines", "add", str(pool.run.path), "--local", "--count", "1")
    assert added.returncode == 0, added.stderr
    record = pools.records(pool.run)[-1]
    index = record.indices[0]
    registration = pool.run.rendezvous / f"engine-{index}.json"
    url, engine_pid = (json.loads(registration.read_text())[k] for k in ("url", "pid"))

    async def drained() -> bool:
        return pools.load(pool.run, record.name).state == "draining" and not registration.exists()

    async def go(link):
        await wait_until(lambda: _in_ring(pool, index))
        nodes = {f"engine-{e['index']}" for e in router_metrics(pool)["engines"] if e["healthy"]}
        session = session_on(f"engine-{index}", nodes, pool.cfg.router.virtual_nodes)
        params = {"max_tokens": 60, "seed": 2, **NO_STOP}  # held there through the warning
        task, _ = await freeze_mid_answer(link, url, session, lambda: link.generate([5, 6, 7], params, session))
        for pid in (record.pid, engine_pid):
            os.kill(pid, signal.SIGUSR2)
        await wait_until(drained)
        assert (await client.health(link.session, url, token=link.token))["running"] == 1
        await client.resume(link.session, url, token=link.token)
        return await task, link.take_counts()

    out, counts = with_link(pool, go)
    assert len(out.token_ids) == 60 and counts["requests_migrated"] == 0  # finished on the engine it started on
    assert (
        pools.pid_alive(engine_pid)
        and "SIGUSR2 (the time limit is near" in (pool.run.logs / f"{record.name}.log").read_text()
    )
    removed = cli("engines", "remove", str(pool.run.path), record.name, "--drain-s", "0")
    assert removed.returncode == 0, removed.stderr
    assert pools.load(pool.run, record.name).state == "removed" and not pools.pid_alive(record.pid)


async def _in_ring(pool, index: int) -> bool:
    return any(e["index"] == index and e["healthy"] for e in router_metrics(pool)["engines"])


def test_an_empty_ring_keeps_its_version_for_the_engines_that_join(tmp_path) -> None:
    """Every engine out at once (health checks that time out under load) leaves the ring's version as it was: an
    engine restarted on older weights still waits for its refit; the ring's own engines set it, a rollback too."""
    ring = EnginePool(RunDir(tmp_path), RouterConfig(), "token")
    assert ring.serving_version() is None  # never had an engine: anyone joins
    ring.engines = {0: Engine(0, "http://a", healthy=True, version=8), 1: Engine(1, "http://b", version=0)}
    assert ring.serving_version() == 8
    ring.engines[0].healthy = False
    assert ring.serving_version() == 8 and not admits(ring.engines[1].version, ring.serving_version())
    ring.engines[0].healthy, ring.engines[0].version = True, 5  # the trainer resumed from an older checkpoint
    assert ring.serving_version() == 5
