"""A failed engine call continues on another engine from the tokens it had streamed; nothing decoded is lost.

Real engine and router processes (the shared pool); the fault lands while every request of a long group
is in flight with tokens streamed. The kept tokens must be the start of the finished action, with the same
log-probs, and the whole trace must still match a teacher-forced forward (exact log-probs per token).
"""

import contextlib
import signal
import socket

import numpy as np
import pytest

from molt_hpc.agents.loader import load_agent
from molt_hpc.agents.step_runner import StepEnvRunner
from molt_hpc.data import Position
from molt_hpc.engine import client
from molt_hpc.engine.client import GenerateResult
from molt_hpc.engine.stream import Partial
from molt_hpc.rollout.engines import EngineLink
from molt_hpc.rollout.group import run_group
from molt_hpc.rollout.resume import Segments, continuation_seed
from molt_hpc.rundir import RunDir
from tests.rollout_support import check_logprobs, env_file, long_group, with_link
from tests.test_rollout_procs import router_metrics

pytestmark = pytest.mark.timeout(300)
STREAMED = 12


def check_kept(held, model) -> None:
    """Every sample is whole (200 tokens, exact log-probs), none restarted, and what each session had
    streamed when the fault came is the start of its action, log-probs and all."""
    outcome = held.outcome
    assert outcome.failure is None and outcome.engine_retries == 0 and outcome.tokens_discarded == 0
    assert len(held.streamed) == 4 and all(len(p.token_ids) >= STREAMED for p in held.streamed.values())
    by_session = {f"{s.rollout_id}.a0": s for s in outcome.group.samples}
    for session, partial in held.streamed.items():
        sample = by_session[session]
        assert sample.num_action_tokens == 200
        n = len(partial.token_ids)
        assert sample.tokens[sample.prompt_len : sample.prompt_len + n] == partial.token_ids
        assert sample.action_logprobs[:n] == partial.logprobs
        assert sample.versions == [0] * 200
        check_logprobs(model, sample)


def test_an_engine_killed_mid_request_continues_elsewhere_from_its_tokens(pool, tok, model, dataset) -> None:
    killed = []

    async def kill_a_busy_engine(link):
        busy = max(router_metrics(pool)["engines"], key=lambda e: e["in_flight"])
        assert busy["in_flight"] > 0
        killed.append((pool.engines[busy["index"]], busy["in_flight"]))
        killed[0][0].signal(signal.SIGKILL)

    try:
        held = long_group(pool, tok, dataset, kill_a_busy_engine, streamed=STREAMED)
    finally:
        for proc, _ in killed:
            with contextlib.suppress(Exception):
                proc.proc.wait(timeout=10)
    (proc, on_it), metrics = killed[0], router_metrics(pool)
    assert not metrics["engines"][pool.engines.index(proc)]["healthy"]
    check_kept(held, model)
    # Each request the killed engine held continued elsewhere, carrying at least what it had streamed.
    assert held.counts["requests_migrated"] == on_it
    assert held.counts["tokens_migrated"] >= STREAMED * on_it


def test_an_aborted_request_continues_from_its_tokens(pool, tok, model, dataset) -> None:
    async def abort_all(link):
        for i in range(len(pool.engines)):
            if pool.engines[i].proc.poll() is None:
                await client.pause(link.session, pool.engine_url(i), token=link.token, mode="abort")

    held = long_group(pool, tok, dataset, abort_all, streamed=STREAMED)
    check_kept(held, model)
    assert held.counts["requests_migrated"] == 4
    assert held.counts["tokens_migrated"] >= sum(len(p.token_ids) for p in held.streamed.values())


COUNTING_ENV = """
EPISODES = []
class Counting(Env):
    def __init__(self):
        EPISODES.append(0)
    def step(self, state):
        EPISODES[-1] += 1
        return Result(0.5, observation="more", terminated=state.turn == 2)
"""


def dead_link(link, run: RunDir, resumes: int) -> tuple[EngineLink, socket.socket]:
    """A link to a port nobody listens on (a real "connection refused"), following `run`'s router."""
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{closed.getsockname()[1]}"
    return EngineLink(link.session, url, link.token, run, 5, resumes=resumes), closed


def counting_run(pool, tok, dataset, tmp_path, second_turn):
    env_cls = load_agent(env_file(tmp_path, COUNTING_ENV))
    cfg = pool.cfg.rollout.model_copy(update={"max_turns": 3, "max_total_tokens": 256, "n_samples": 1})

    async def go(link):
        calls = []

        async def generate(token_ids, params, session_id):
            calls.append(session_id)
            return await second_turn(link, len(calls)).generate(token_ids, params, session_id)

        runner = StepEnvRunner(env_cls, tok, cfg, generate)
        return await run_group(runner, dataset[4], Position(0, 4), cfg), calls

    outcome, calls = with_link(pool, go)
    return outcome, calls, __import__(env_cls.__module__).EPISODES


def test_a_lost_connection_continues_the_turn_through_the_router(pool, tok, model, dataset, tmp_path) -> None:
    sockets = []

    def second_turn(link, call):
        if call != 2:
            return link
        dead, closed = dead_link(link, pool.run, resumes=3)  # it re-reads router.json after the failure
        sockets.append(closed)
        return dead

    outcome, calls, episodes = counting_run(pool, tok, dataset, tmp_path, second_turn)
    for s in sockets:
        s.close()
    # Turn 1 lost its connection and went on through the router: one episode, no restart.
    assert outcome.failure is None and outcome.engine_retries == 0 and outcome.tokens_discarded == 0
    assert calls == ["e0-i4.s0.a0"] * 3 and episodes == [3]
    (traj,) = outcome.group.samples
    assert len(traj.action_ranges) == 3 and traj.reward == 1.5
    assert traj.tokens[: traj.prompt_len] == dataset[4].token_ids
    check_logprobs(model, traj)


def test_a_turn_that_cannot_continue_restarts_the_sample_and_counts_what_it_discards(
    pool, tok, model, dataset, tmp_path
) -> None:
    nowhere = RunDir(tmp_path / "nowhere")  # no router registered: the dead link has nowhere to go
    (nowhere.path / "rendezvous").mkdir(parents=True)
    sockets = []

    def second_turn(link, call):
        if call != 2:
            return link
        dead, closed = dead_link(link, nowhere, resumes=1)
        sockets.append(closed)
        return dead

    outcome, calls, episodes = counting_run(pool, tok, dataset, tmp_path, second_turn)
    for s in sockets:
        s.close()
    assert outcome.failure is None and outcome.engine_retries == 1
    assert calls == ["e0-i4.s0.a0", "e0-i4.s0.a0", "e0-i4.s0.a1", "e0-i4.s0.a1", "e0-i4.s0.a1"]
    assert episodes == [1, 3]
    (traj,) = outcome.group.samples
    check_logprobs(model, traj)
    # What the restart threw away: the first attempt's first turn (the second never produced a token).
    assert 1 <= outcome.tokens_discarded <= pool.cfg.rollout.max_new_tokens


def result(tokens, version=0, routed=None, reason="stop") -> GenerateResult:
    return GenerateResult(list(tokens), [-0.5] * len(tokens), reason, [version] * len(tokens), version, routed)


def test_segments_merge_in_order_with_each_tokens_version_and_routing() -> None:
    seg = Segments([1, 2, 3], {"max_tokens": 10, "seed": 7, "stop_token_ids": [99], "routed_experts_prompt_start": 1})
    assert seg.request() == ([1, 2, 3], seg.params)
    broken = Partial([5, 6], [-0.1, -0.2], [4, 4])  # a broken stream: tokens, no routing
    seg.keep(broken)
    ids, params = seg.request()
    assert ids == [1, 2, 3, 5, 6] and params["max_tokens"] == 8 and params["seed"] == continuation_seed(7, 2)
    assert params["routed_experts_prompt_start"] == 1  # nobody reported rows past position 1 yet
    aborted = result([7], version=4, routed=np.ones((5, 2, 1), np.uint8), reason="abort")  # rows [1, 6)
    seg.keep(aborted)
    ids, params = seg.request()
    assert ids == [1, 2, 3, 5, 6, 7] and params["max_tokens"] == 7 and params["routed_experts_prompt_start"] == 6
    last = result([8, 99], version=5, routed=np.full((2, 2, 1), 3, np.uint8))  # rows [6, 8)
    out = seg.merged(last)
    assert out.token_ids == [5, 6, 7, 8, 99] and out.weight_versions == [4, 4, 4, 5, 5]
    assert out.logprobs == [-0.1, -0.2, -0.5, -0.5, -0.5] and out.finish_reason == "stop"
    assert out.routed_experts.tolist() == [[[1]] * 2] * 5 + [[[3]] * 2] * 2  # 1 + 7 rows: P + G - 1 - start
    assert seg.carried == 3


def test_kept_tokens_that_end_the_request_need_no_other_call() -> None:
    seg = Segments([1], {"max_tokens": 3, "stop_token_ids": [9]})
    seg.keep(Partial([4, 9], [-1.0, -2.0], [0, 1]))
    assert seg.finished() == "stop"
    out = seg.merged(None, "stop")
    assert out.token_ids == [4, 9] and out.weight_versions == [0, 1] and out.weight_version == 1
    capped = Segments([1], {"max_tokens": 2})
    capped.keep(Partial([4, 5], [-1.0, -1.0], [0, 0]))
    assert capped.finished() == "length" and Segments([1], {"max_tokens": 2}).finished() is None
