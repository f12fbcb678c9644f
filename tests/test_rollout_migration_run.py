"""A whole orchestrator run through an engine killed with SIGKILL mid-request: nothing decoded is lost.

The orchestrator runs in this process against the shared pool plus one more engine process; once that
engine holds requests that have streamed tokens, it is frozen and killed. Its requests continue on the
other engine from their tokens: no sample starts again (the env is reset once per sample), no token is
discarded, and the buffer holds every group the cursor passed, each exactly once.
"""

import asyncio
import json
import signal
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path

import pytest

from molt_hpc.buffer import open_buffer
from molt_hpc.data import Cursor, Position, PromptDataset
from molt_hpc.log import read_metrics
from molt_hpc.models import load_tokenizer
from molt_hpc.rollout.main import serve
from molt_hpc.rollout.state import RolloutState
from tests.test_rollout_procs import base_overrides, make_run, shared_pool, wait_file, wait_router_sees

pytestmark = pytest.mark.timeout(300)
EXTRA = 7
"""Index of the engine this test adds to the shared pool, then kills."""

LONG_ENV = """
from molt_hpc.agents import Env, Result
class Long(Env):
    def reset(self, state):
        with open(RESETS, "a") as log:
            log.write(state.label + "\\n")
        return {"observation": None, "sampling_params": {"ignore_eos": True, "stop_token_ids": []}}
    def step(self, state):
        return Result(float(len(state.action_text) % 3))
"""


@pytest.fixture(scope="module")
def pool(tmp_path_factory, tiny_model_dir):
    return shared_pool(tmp_path_factory.mktemp("pool"), tiny_model_dir)


def engine_status(url: str, pool) -> dict:
    req = urllib.request.Request(url + "/health", headers=pool.run.auth_headers())
    with urllib.request.urlopen(req, timeout=5) as r:
        return json.loads(r.read())


def post(url: str, pool) -> None:
    headers = {**pool.run.auth_headers(), "Content-Type": "application/json"}
    req = urllib.request.Request(url, data=b"{}", headers=headers)
    urllib.request.urlopen(req, timeout=5).close()


def kill_when_busy(pool, proc, url: str, killed: list) -> threading.Thread:
    """In the background: once the engine at `url` runs requests that have taken 20 steps, freeze it, then
    SIGKILL it (what it held has streamed its tokens and must continue elsewhere)."""

    def watch() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            status = engine_status(url, pool)
            if status["running"] and status["steps"] >= 20:
                post(url + "/pause?mode=keep", pool)
                killed.append(engine_status(url, pool)["running"])
                proc.signal(signal.SIGKILL)
                return
            time.sleep(0.02)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def stop_when_done(run, expected: int) -> threading.Thread:
    def watch() -> None:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            state = RolloutState.load(run.path / "rollout" / "state.json")
            if state.groups_accepted >= expected and not state.in_flight:
                break
            time.sleep(0.05)
        (run.path / "control").mkdir(exist_ok=True)
        (run.path / "control" / "stop").touch()

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def test_a_run_goes_on_through_a_killed_engine_and_loses_no_token(pool, tmp_path) -> None:
    extra = pool.start_engine(EXTRA)
    record = pool.run.rendezvous / f"engine-{EXTRA}.json"
    try:
        url = wait_file(record, [extra], pid=extra.proc.pid)["url"]
        wait_router_sees(pool, sum(p.proc.poll() is None for p in pool.engines) + 1)
        env, resets = tmp_path / "long.py", tmp_path / "resets.log"
        env.write_text(LONG_ENV.replace("RESETS", repr(str(resets))))
        overrides = [*base_overrides(Path(pool.cfg.model.path)), f"rollout.agent={json.dumps(str(env))}",
                     "rollout.max_new_tokens=48", "rollout.max_total_tokens=128", "buffer.max_staleness=1"]  # fmt: skip
        run, cfg = make_run(tmp_path, "run", overrides, share=pool.run)
        killed: list[int] = []
        killer, stopper = kill_when_busy(pool, extra, url, killed), stop_when_done(run, 8)
        assert asyncio.run(serve(cfg, run)) == 0
        killer.join(), stopper.join()
    finally:
        extra.stop()
        record.unlink(missing_ok=True)
    assert killed and killed[0] >= 1
    groups = open_buffer(cfg.buffer, run.path, consumer_id="test").get(64, timeout=1)
    dataset = PromptDataset.load(cfg.data, load_tokenizer(cfg.model.path))
    cursor = Cursor(dataset, cfg.data, seed=cfg.run.seed)
    assert sorted(g.group_id for g in groups) == sorted(f"e0-i{i}" for i in range(8))  # each group once
    assert Counter(g.prompt_id for g in groups) == Counter(cursor.at(Position(0, i)).prompt_id for i in range(8))
    samples = [s for g in groups for s in g.samples]
    assert all(s.num_action_tokens == 48 and s.versions == [0] * 48 for s in samples)
    # One reset per sample: no sample started again from its first token.
    assert len(resets.read_text().split("\n")) - 1 == len(samples) == 16
    records = read_metrics(run.metrics, source="rollout")
    total = Counter()
    for r in records:
        total.update({k: r.get(k, 0) for k in ("tokens_migrated", "requests_migrated", "tokens_discarded",
                                               "samples_engine_retries")})  # fmt: skip
    assert total["tokens_discarded"] == 0 and total["samples_engine_retries"] == 0
    assert total["requests_migrated"] == killed[0] and total["tokens_migrated"] >= killed[0]
