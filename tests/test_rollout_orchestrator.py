"""The orchestrator against a real engine pool: admission, completion order, metrics, stop and resume.

One pool (an engine and the router) serves the module; every test gets its own run directory
(buffer, state, metrics) sharing the pool's token and rendezvous files.
"""

import asyncio
import json
import random
import signal
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from molt_hpc.buffer import open_buffer
from molt_hpc.config import load_config
from molt_hpc.data import Cursor, Position, PromptDataset
from molt_hpc.log import read_metrics
from molt_hpc.models import load_tokenizer
from molt_hpc.rollout.admission import KeptShare, admits, lands_stale
from molt_hpc.rollout.group import GroupOutcome
from molt_hpc.rollout.main import serve
from molt_hpc.rollout.orchestrator import over_drop_budget, shape_group
from molt_hpc.rollout.state import SAVE_EVERY_S, RolloutState
from molt_hpc.trajectory import Group, Trajectory, finished_reward
from tests.test_rollout_procs import ROOT, base_overrides, make_run, shared_pool, spawn

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def pool(tmp_path_factory, tiny_model_dir):
    return shared_pool(tmp_path_factory.mktemp("pool"), tiny_model_dir)


def test_admission_formula() -> None:
    # (version + staleness + 1) × groups_per_step groups may be accepted or in flight.
    assert [admits(a, 0, 0, 2, 4) for a in (11, 12)] == [True, False]
    assert admits(8, 3, 0, 2, 4) and not admits(8, 4, 0, 2, 4)
    assert admits(12, 0, 1, 2, 4) and not admits(16, 0, 1, 2, 4)
    assert [admits(a, 0, 0, 0, 4) for a in (3, 4)] == [True, False]  # sync: one batch per version


def test_kept_share_admission() -> None:
    # Groups in flight count at the kept share: with one in four kept, 4 accepted and a bound of 12 (version
    # 0, staleness 2, 4 a step), up to 31 may be in flight (4 + 31/4 < 12), not 7.
    assert admits(4, 31, 0, 2, 4, kept_share=0.25) and not admits(4, 32, 0, 2, 4, kept_share=0.25)
    assert [admits(4, f, 0, 2, 4, 1.0) for f in (7, 8)] == [admits(4, f, 0, 2, 4) for f in (7, 8)] == [True, False]
    share = KeptShare(groups_per_step=2)  # a window of 8 finished groups
    assert share.share() == 1.0  # no history yet: as `bound`
    for kept in [True, False, False, False] * 3:
        share.add(kept)
    assert share.share() == 2 / 8  # only the last 8 count
    for _ in range(8):
        share.add(False)
    assert share.share() == 1 / 8  # never 0: one kept group a window at the least


def test_a_group_lands_stale_exactly_when_the_trainer_would_see_it_too_old() -> None:
    # Independently: the trainer takes groups in order, `gps` a step, so accepted group number a (from 0) is
    # trained by version a // gps; the buffer moves it aside when that is more than `s` past its oldest token.
    for gps, s, v in [(4, 1, 0), (4, 2, 3), (1, 0, 5), (16, 1, 2)]:
        for a in range(40):
            assert lands_stale(a, v, s, gps) == (a // gps - v > s), (gps, s, v, a)


def outcome_with(lengths: list[int], rewards: list[float]) -> GroupOutcome:
    samples = [
        Trajectory(tokens=[0] * (10 + n), prompt_len=10, action_ranges=[(10, 10 + n)], action_logprobs=[0.0] * n,
                   versions=[0] * n, reward=r)
        for n, r in zip(lengths, rewards, strict=True)
    ]  # fmt: skip
    return GroupOutcome(Position(0, 0), None, Group("e0-i0", "p", samples))


def test_groups_are_shaped_then_filtered() -> None:
    cfg = load_config(None, ["algorithm.overlong_buffer=4", "algorithm.overlong_penalty=1.0",
                             "rollout.max_new_tokens=8"])  # fmt: skip
    # Response cap 8, buffer 4: lengths up to 4 are free, then the penalty grows by 1/4 per token.
    group, why = shape_group(outcome_with([4, 6, 8], [1.0, 1.0, 1.0]), cfg)
    assert why is None and group.rewards == [1.0, 0.5, 0.0]
    assert [s.score for s in group.samples] == [1.0, 1.0, 1.0]  # the score keeps the task's value
    assert shape_group(outcome_with([4, 2], [1.0, 1.0]), cfg) == (None, "equal_rewards")
    kept, why = shape_group(outcome_with([4, 2], [1.0, 1.0]), load_config(None, ["algorithm.dynamic_sampling=false"]))
    assert why is None and kept.rewards == [1.0, 1.0]
    failed = GroupOutcome(Position(0, 0), None, failure="env_timeout")
    assert shape_group(failed, cfg) == (None, "env_timeout")
    # With the drop budget spent, an equal-reward group is trained instead of dropped; a failure still drops.
    kept, why = shape_group(outcome_with([4, 2], [1.0, 1.0]), cfg, over_budget=True)
    assert why is None and kept.rewards == [1.0, 1.0]
    assert shape_group(failed, cfg, over_budget=True) == (None, "env_timeout")


def test_finished_reward_averages_every_sample_the_groups_report() -> None:
    def group(rewards: list[float], report: list | None = None) -> Group:
        g = outcome_with([3] * len(rewards), rewards).group
        if report is not None:
            g.meta["finished_rewards"] = report
        return g

    # [1, 0] plus 6 dropped samples worth 2.0; [1, 1] reporting only itself; [0.5, 0.5] written before the record.
    groups = [group([1.0, 0.0], [3.0, 8]), group([1.0, 1.0], [2.0, 2]), group([0.5, 0.5])]
    assert finished_reward(groups) == pytest.approx((1 + 0 + 2.0 + 1 + 1 + 0.5 + 0.5) / (8 + 2 + 2))
    assert finished_reward([]) is None


def test_drop_budget() -> None:
    # budget 4 with 8 groups a step: 32 drops of slack, then 4 more per accepted group
    assert not over_drop_budget(31, 0, 4.0, 8) and over_drop_budget(32, 0, 4.0, 8)
    assert not over_drop_budget(71, 10, 4.0, 8) and over_drop_budget(72, 10, 4.0, 8)
    assert over_drop_budget(3, 0, 0.25, 8) and not over_drop_budget(1, 0, 0.25, 8)


def read_state(run) -> RolloutState:
    return RolloutState.load(run.path / "rollout" / "state.json")


def stop_when_settled(run, expected: int, timeout: float = 120) -> threading.Thread:
    """In the background: once `expected` groups are accepted and none is in flight, ask the run to stop."""

    def watch() -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = read_state(run)
            if state.groups_accepted >= expected and not state.in_flight:
                time.sleep(0.8)  # long enough for a wrongly admitted group to show up in the state
                break
            time.sleep(0.05)
        (run.path / "control").mkdir(exist_ok=True)
        (run.path / "control" / "stop").touch()

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


SLOW_FIRST = """
import time
from molt_hpc.agents import Env, Result
from molt_hpc.buffer import find_spool, spool_counts
class SlowFirst(Env):
    def step(self, state):
        # The first prompt's samples finish only once another group reached the buffer: an orchestrator
        # that waited for groups in issue order would hold that one back, and this step would time out.
        while state.row.get("id") == SLOW_ID and spool_counts(find_spool(RUN_DIR))["pending"] == 0:
            time.sleep(0.02)
        reward = float(len(state.action_text) % 2)
        with open(REWARD_LOG, "a") as log:  # every reward given, whatever becomes of its group
            log.write(f"{reward}\\n")
        return Result(reward)
"""


@pytest.mark.parametrize(("sync", "expected"), [(False, 8), (True, 4)])
def test_groups_arrive_in_completion_order_within_the_staleness_bound(pool, tmp_path, sync, expected) -> None:
    dataset = PromptDataset.load(pool.cfg.data, load_tokenizer(pool.cfg.model.path))
    slow_id = Cursor(dataset, pool.cfg.data, seed=0).at(Position(0, 0)).prompt_id
    env = tmp_path / "slow_first.py"
    overrides = [*base_overrides(Path(pool.cfg.model.path)), f"rollout.agent={json.dumps(str(env))}",
                 "buffer.max_staleness=1", f"run.sync={str(sync).lower()}"]  # fmt: skip
    run, cfg = make_run(tmp_path, "run", overrides, share=pool.run)
    reward_log = tmp_path / "rewards.log"
    env.write_text(
        SLOW_FIRST.replace("SLOW_ID", repr(slow_id))
        .replace("RUN_DIR", repr(str(run.path)))
        .replace("REWARD_LOG", repr(str(reward_log)))
    )
    watcher = stop_when_settled(run, expected)
    assert asyncio.run(serve(cfg, run)) == 0
    watcher.join()

    state = read_state(run)
    # Admission: (engine version 0 + max_staleness + 1) × groups_per_step groups, not one more.
    assert state.groups_accepted == expected and state.in_flight == []
    assert state.cursor["position"] == expected
    groups = open_buffer(cfg.buffer, run.path, consumer_id="test").get(64, timeout=1)
    ids = [g.group_id for g in groups]
    assert sorted(ids) == sorted(f"e0-i{i}" for i in range(expected))
    assert ids[0] != "e0-i0"  # the slow first group did not hold the others back
    assert all(len(g.samples) == 2 and g.min_version == 0 for g in groups)
    records = read_metrics(run.metrics, source="rollout")
    batches = [r for r in records if r.get("groups_accepted") == 4]
    assert len(batches) == expected // 4
    assert all(r["tokens_per_s"] > 0 and r["groups_per_s"] > 0 for r in batches)
    # Equal-sized windows: the mean of the window means of `reward_trained` is the mean over the buffer.
    trained = [s.reward for g in groups for s in g.samples]
    assert sum(r["reward_trained"] for r in batches) / len(batches) == pytest.approx(sum(trained) / len(trained))
    # `reward` is the mean over every finished sample, the ones of groups dynamic sampling dropped too:
    # the env's own log of what it gave is the independent count.
    given = [float(x) for x in reward_log.read_text().split()]
    windows = [r for r in records if r.get("samples_finished")]
    assert sum(r["samples_finished"] for r in windows) == len(given)
    weighted = sum(r["reward"] * r["samples_finished"] for r in windows) / len(given)
    assert weighted == pytest.approx(sum(given) / len(given))
    # What the trainer averages: each group reports its samples and the dropped ones before it; the last
    # group accepted is the last to finish (admission), so together they report every reward given.
    reported = [g.meta["finished_rewards"] for g in groups]
    assert sum(c for _, c in reported) == len(given) and sum(t for t, _ in reported) == pytest.approx(sum(given))
    assert finished_reward(groups) == pytest.approx(sum(given) / len(given))


def wait_for(predicate, timeout: float, proc=None) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc is not None and proc.proc.poll() is not None:
            raise RuntimeError(f"the orchestrator exited with {proc.proc.returncode}:\n{proc.tail()}")
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached" + (f":\n{proc.tail()}" if proc else ""))
        time.sleep(0.05)


SLOW_REVERSE = """
import time
from molt_hpc.agents import Env, Result
class SlowReverse(Env):
    def step(self, state):
        time.sleep(0.2)  # slow enough that kills land while groups are in flight
        return Result(float(state.action_text.strip() == str(state.label)))
"""


def test_kill_9_at_random_points_loses_and_duplicates_nothing(pool, tmp_path) -> None:
    env = tmp_path / "slow_reverse.py"
    env.write_text(SLOW_REVERSE)
    eval_path = json.dumps(str(ROOT / "data" / "reverse_eval.jsonl"))
    overrides = [*base_overrides(Path(pool.cfg.model.path)), "buffer.max_staleness=9",
                 f"rollout.agent={json.dumps(str(env))}", "eval.every=1", "eval.max_prompts=4",
                 f"eval.path={eval_path}"]  # fmt: skip
    run, cfg = make_run(tmp_path, "run", overrides, share=pool.run)
    expected = 40  # (version 0 + staleness 9 + 1) × 4 groups per step
    state_file = run.path / "rollout" / "state.json"
    rng = random.Random(7)
    kills = 0
    for _ in range(3):
        # Killed at a random point of its progress: after 1 or 2 writes of its state (the first comes with the
        # first issue, the next at least SAVE_EVERY_S later), then up to one more interval, so that the kill
        # mostly finds groups issued or finished since the file's last write.
        proc = spawn("rollout.py", [str(run.path)], run.logs / "rollout.log")
        for _ in range(rng.randint(1, 2)):
            before = state_file.stat().st_mtime_ns if state_file.exists() else 0
            wait_for(lambda b=before: state_file.exists() and state_file.stat().st_mtime_ns != b, 60, proc)
        time.sleep(rng.uniform(0.0, SAVE_EVERY_S))
        if proc.proc.poll() is None:
            proc.proc.kill()
            kills += 1
        proc.proc.wait()
    assert kills == 3 and read_state(run).groups_accepted < expected
    proc = spawn("rollout.py", [str(run.path)], run.logs / "rollout.log")

    def settled() -> bool:
        state = read_state(run)
        evaluated = any("eval_reward" in r for r in read_metrics(run.metrics, source="eval"))
        return state.groups_accepted == expected and not state.in_flight and evaluated

    wait_for(settled, 120, proc)
    time.sleep(0.5)
    proc.signal(signal.SIGTERM)
    assert proc.proc.wait(timeout=30) == 0, proc.tail()

    state = read_state(run)
    assert state.groups_accepted == expected and state.cursor["position"] == expected
    groups = open_buffer(cfg.buffer, run.path, consumer_id="test").get(64, timeout=1)
    dataset = PromptDataset.load(cfg.data, load_tokenizer(cfg.model.path))
    cursor = Cursor(dataset, cfg.data, seed=cfg.run.seed)
    passed = Counter(cursor.at(Position(0, i)).prompt_id for i in range(expected))
    assert Counter(g.prompt_id for g in groups) == passed  # every prompt the cursor passed, each once
    assert sorted(g.group_id for g in groups) == sorted(f"e0-i{i}" for i in range(expected))
    evals = [r for r in read_metrics(run.metrics, source="eval") if "eval_reward" in r]
    assert evals and evals[0]["eval_version"] == 0 and evals[0]["eval_prompts"] == 4


KEPT_ONE_IN_FOUR = """
import hashlib, random, time
from molt_hpc.agents import Env, Result
class KeptOneInFour(Env):
    def step(self, state):
        if int(hashlib.md5(state.row["id"].encode()).hexdigest(), 16) % 4:
            return Result(0.0)  # three prompts in four: equal rewards, dropped by dynamic sampling
        time.sleep(0.5)  # the kept ones finish late, as a hard prompt's long answers do
        return Result(random.random())
"""


def test_kept_share_admission_holds_more_in_flight_and_trains_nothing_stale(pool, tmp_path) -> None:
    env = tmp_path / "kept_one_in_four.py"
    env.write_text(KEPT_ONE_IN_FOUR)
    overrides = [*base_overrides(Path(pool.cfg.model.path)), f"rollout.agent={json.dumps(str(env))}",
                 "buffer.max_staleness=1", "rollout.groups_in_flight=16", "rollout.admission=kept_share",
                 "algorithm.dynamic_sampling=true", "algorithm.dynamic_sampling_budget=1000"]  # fmt: skip
    run, cfg = make_run(tmp_path, "run", overrides, share=pool.run)
    bound = 2 * cfg.actor.groups_per_step  # version 0 (no trainer), staleness 1
    watcher = stop_when_settled(run, bound)
    assert asyncio.run(serve(cfg, run)) == 0
    watcher.join()

    state = read_state(run)
    assert state.groups_accepted == bound and state.in_flight == []  # not one group past the bound
    assert state.cursor["position"] == state.groups_accepted + state.groups_dropped  # every issued group accounted
    groups = open_buffer(cfg.buffer, run.path, consumer_id="test").get(64, timeout=1)
    assert len(groups) == bound and all(g.min_version == 0 and len(set(g.rewards)) == 2 for g in groups)
    records = read_metrics(run.metrics, source="rollout")
    # `bound` admission never has more than `bound` groups in flight; at a kept share of about 1/4 this held
    # up to groups_in_flight
    assert max(r["in_flight_max"] for r in records) > bound
    dropped = sum(r.get("groups_filtered_equal_rewards", 0) + r.get("groups_filtered_stale", 0) for r in records)
    assert dropped == state.groups_dropped
