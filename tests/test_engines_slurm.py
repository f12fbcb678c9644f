"""Extra engine pools as jobs of their own on a real local Slurm cluster, joining the shared pool's live run.

Two pool jobs join and serve. A request pool A's engine holds mid-answer continues on another engine when
the job is requeued (what a preemption in REQUEUE mode does), and again when A, back after its requeue,
reaches its time limit: Slurm's warning signal first (the pool leaves the ring, its engine keeps the
request), then slurmctld's time-limit kill (SIGTERM, SIGKILL only after KillWait), and the job ends as
TIMEOUT, not requeued. Pool B is removed (scancel) mid-answer. No token is lost any time.
"""

import asyncio
import json
import re

import pytest

from molt_hpc.launch import pools
from molt_hpc.launch.elastic import held
from tests.conftest import molt
from tests.rollout_support import NO_STOP, freeze_mid_answer, wait_until, with_link
from tests.test_engines_elastic import session_on
from tests.test_rollout_procs import router_metrics, shared_pool

pytest_plugins = ["tests.slurm_cluster"]
pytestmark = [pytest.mark.slurm, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def pool(tmp_path_factory, tiny_model_dir):
    return shared_pool(tmp_path_factory.mktemp("pool"), tiny_model_dir)


ANSWER = 150
"""Tokens of the answer to cut; the engine holds it after its 12th (`freeze_mid_answer`)."""


async def in_ring(pool, index: int, pid: int | None = None) -> bool:
    path = pool.run.rendezvous / f"engine-{index}.json"
    if not path.exists() or (pid is not None and json.loads(path.read_text())["pid"] == pid):
        return False
    return any(e["index"] == index and e["healthy"] for e in router_metrics(pool)["engines"])


async def cut_mid_answer(pool, link, index: int, cut) -> tuple:
    """A long request the pool's engine holds, frozen after 12 tokens, then `cut(url)`; the answer, the kept
    tokens and the link's counts."""
    nodes = {f"engine-{e['index']}" for e in router_metrics(pool)["engines"] if e["healthy"]}
    session = session_on(f"engine-{index}", nodes, pool.cfg.router.virtual_nodes)
    url = json.loads((pool.run.rendezvous / f"engine-{index}.json").read_text())["url"]
    params = {"max_tokens": ANSWER, "seed": 1, **NO_STOP}
    task, kept = await freeze_mid_answer(link, url, session, lambda: link.generate([1, 2, 3], params, session))
    await asyncio.to_thread(cut, url)
    return await task, kept, link.take_counts()


def check(result) -> None:
    out, kept, counts = result
    assert len(out.token_ids) == ANSWER and out.token_ids[: len(kept)] == kept and len(kept) == 12
    assert counts["requests_migrated"] == 1 and counts["tokens_migrated"] >= len(kept)


def add_pool(run: str) -> str:
    added = molt("engines", "add", run, "--count", "1", "--partition", "debug", "--time", "00:10:00")
    assert added.returncode == 0, added.stderr
    return re.search(r"submitted job (\d+)", added.stdout).group(1)


def reach_time_limit(cluster, pool, job: str, record, url: str) -> None:
    """Slurm's warning, sent to the job's steps as slurmctld does `slurm.signal_lead_s` before the limit; once
    the pool left the ring with the request still held, the limit itself: a time limit of 0 minutes puts the
    job's end at now, and slurmctld's next time-limit check (every 30 s) ends it."""
    cluster.slurm("scancel", "--signal=USR2", job)
    registration = pool.run.rendezvous / f"engine-{record.indices[0]}.json"
    drained = lambda: pools.load(pool.run, record.name).state == "draining" and not registration.exists()  # noqa: E731
    cluster.wait_for(drained, timeout=60, what="the pool to leave the ring on the warning")
    assert held(url, pool.run.token()) == 1  # the warning hands nothing on: the engine still holds the request
    cluster.slurm("scontrol", "update", f"JobId={job}", "TimeLimit=0")


def test_slurm_pools_requeued_time_limited_and_removed_without_losing_a_token(slurm_cluster, pool) -> None:
    run = str(pool.run.path)
    dry = molt("engines", "add", run, "--partition", "debug", "--qos", "normal", "--dry-run")
    assert dry.returncode == 0 and "#SBATCH --partition=debug" in dry.stdout and "#SBATCH --qos=normal" in dry.stdout
    assert f"#SBATCH --signal=USR2@{pool.cfg.slurm.signal_lead_s}\n" in dry.stdout
    assert not any(r.mode == "slurm" for r in pools.records(pool.run))  # a dry run creates nothing
    job_a, job_b = add_pool(run), add_pool(run)
    a, b = (next(r for r in pools.records(pool.run) if r.job_id == job) for job in (job_a, job_b))
    try:

        async def go(link):
            await wait_until(lambda: in_ring(pool, a.indices[0]), timeout=240)
            await wait_until(lambda: in_ring(pool, b.indices[0]), timeout=240)
            listed = molt("engines", "list", run)
            assert job_a in listed.stdout and job_b in listed.stdout and "serving" in listed.stdout, listed.stdout
            first_pid = json.loads((pool.run.rendezvous / f"engine-{a.indices[0]}.json").read_text())["pid"]
            requeue = lambda _url: slurm_cluster.slurm("scontrol", "requeue", job_a)  # noqa: E731
            requeued = await cut_mid_answer(pool, link, a.indices[0], requeue)
            remove = lambda _url: molt("engines", "remove", run, b.name, "--drain-s", "0", timeout=180)  # noqa: E731
            removed = await cut_mid_answer(pool, link, b.indices[0], remove)  # while A starts again
            await wait_until(lambda: in_ring(pool, a.indices[0], pid=first_pid), timeout=300)  # back after its requeue
            limit = lambda url: reach_time_limit(slurm_cluster, pool, job_a, a, url)  # noqa: E731
            timed_out = await cut_mid_answer(pool, link, a.indices[0], limit)
            return requeued, removed, timed_out

        for result in with_link(pool, go):
            check(result)
        assert slurm_cluster.wait_end(job_a, timeout=120) == "TIMEOUT"
        assert slurm_cluster.job_field(job_a, "Restarts") == "1"  # requeued once, never for its time limit
        assert slurm_cluster.wait_end(job_b, timeout=120) == "CANCELLED"
        assert pools.load(pool.run, a.name).state == "ended" and pools.load(pool.run, b.name).state == "removed"
        assert not (pool.run.rendezvous / f"engine-{a.indices[0]}.json").exists()
        # Both of A's ends went through the engine's own shutdown (unregister, hand on the requests), and the
        # time limit's through the supervisor's warning path first.
        assert (pool.run.logs / f"engine-{a.indices[0]}.log").read_text().count("] stopping") == 2
        log = (pool.run.path / "pools" / f"{a.name}-submitit" / f"{job_a}_0_log.err").read_text()
        warned = log.index(f"pool {a.name}: SIGUSR2 (the time limit is near")
        assert log.index(f"pool {a.name} stopped on SIGTERM: engine {a.indices[0]} exit 0", warned) > warned
    finally:
        for job in (job_a, job_b):
            slurm_cluster.slurm("scancel", job, check=False)
