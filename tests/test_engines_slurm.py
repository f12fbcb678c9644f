"""An extra engine pool as its own job on a real local Slurm cluster, joining the shared pool's live run.

The pool job's engine registers and serves; a request it holds mid-answer continues on the run's own
engine when the job is requeued (what a preemption in REQUEUE mode does), and again when the pool,
back after its requeue, is removed (scancel). No token is lost either time.
"""

import asyncio
import json
import re

import pytest

from molt_hpc.engine import client
from molt_hpc.launch import pools
from tests.conftest import molt
from tests.rollout_support import NO_STOP, wait_until, with_link
from tests.test_engines_elastic import session_on
from tests.test_rollout_procs import router_metrics, shared_pool

pytest_plugins = ["tests.slurm_cluster"]
pytestmark = [pytest.mark.slurm, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def pool(tmp_path_factory, tiny_model_dir):
    return shared_pool(tmp_path_factory.mktemp("pool"), tiny_model_dir)


async def in_ring(pool, index: int, pid: int | None = None) -> bool:
    path = pool.run.rendezvous / f"engine-{index}.json"
    if not path.exists() or (pid is not None and json.loads(path.read_text())["pid"] == pid):
        return False
    return any(e["index"] == index and e["healthy"] for e in router_metrics(pool)["engines"])


async def cut_mid_answer(pool, link, index: int, cut) -> tuple:
    """A long request the pool's engine holds, frozen after 12 tokens, then `cut()`; the answer, the kept
    tokens and the link's counts."""
    nodes = {f"engine-{e['index']}" for e in router_metrics(pool)["engines"] if e["healthy"]}
    session = session_on(f"engine-{index}", nodes, pool.cfg.router.virtual_nodes)
    url = json.loads((pool.run.rendezvous / f"engine-{index}.json").read_text())["url"]
    task = asyncio.create_task(link.generate([1, 2, 3], {"max_tokens": 150, "seed": 1, **NO_STOP}, session))
    await wait_until(lambda: _streamed(link, session, 12), timeout=120)
    await client.pause(link.session, url, token=link.token, mode="keep")
    kept = list(link.streaming[session].token_ids)
    await asyncio.to_thread(cut)
    return await task, kept, link.take_counts()


async def _streamed(link, session: str, n: int) -> bool:
    return session in link.streaming and len(link.streaming[session].token_ids) >= n


def check(result) -> None:
    out, kept, counts = result
    assert len(out.token_ids) == 150 and out.token_ids[: len(kept)] == kept and len(kept) >= 12
    assert counts["requests_migrated"] == 1 and counts["tokens_migrated"] >= len(kept)


def test_a_slurm_pool_joins_is_requeued_and_removed_without_losing_a_token(slurm_cluster, pool) -> None:
    run = str(pool.run.path)
    dry = molt("engines", "add", run, "--partition", "debug", "--qos", "normal", "--dry-run")
    assert dry.returncode == 0 and "#SBATCH --partition=debug" in dry.stdout and "#SBATCH --qos=normal" in dry.stdout
    assert not any(r.mode == "slurm" for r in pools.records(pool.run))  # a dry run creates nothing
    added = molt("engines", "add", run, "--count", "1", "--partition", "debug", "--time", "00:10:00")
    assert added.returncode == 0, added.stderr
    job = re.search(r"submitted job (\d+)", added.stdout).group(1)
    record = next(r for r in pools.records(pool.run) if r.job_id == job)
    index = record.indices[0]
    try:

        async def go(link):
            await wait_until(lambda: in_ring(pool, index), timeout=240)
            listed = molt("engines", "list", run)
            assert job in listed.stdout and "serving" in listed.stdout, listed.stdout
            first_pid = json.loads((pool.run.rendezvous / f"engine-{index}.json").read_text())["pid"]
            requeued = await cut_mid_answer(pool, link, index, lambda: slurm_cluster.slurm("scontrol", "requeue", job))
            await wait_until(lambda: in_ring(pool, index, pid=first_pid), timeout=300)  # back after its requeue
            removed = await cut_mid_answer(
                pool, link, index, lambda: molt("engines", "remove", run, record.name, "--drain-s", "0", timeout=180)
            )
            return requeued, removed

        requeued, removed = with_link(pool, go)
        check(requeued)
        check(removed)
        slurm_cluster.wait_end(job, timeout=120)
        assert pools.load(pool.run, record.name).state == "removed"
    finally:
        slurm_cluster.slurm("scancel", job, check=False)
