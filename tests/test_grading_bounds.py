"""A pathological answer costs little and fails only its sample: real math-verify, real env worker
processes. A 10 MB reply and answers whose value would explode score 0 in seconds through `envs/math.py`;
what gets past the grader's own bounds (here: math-verify called without them) is stopped at
`rollout.env_timeout_s` by killing its worker, and the other episodes go on."""

import asyncio
import time

import pytest

from molt_hpc.agents.base import State
from molt_hpc.agents.calls import EnvError
from molt_hpc.agents.env_workers import EnvWorkerPool
from molt_hpc.agents.grading import grade
from tests.conftest import ROOT

pytestmark = pytest.mark.timeout(120)
TIMEOUT_S = 3.0
TEN_MB = 10 * 2**20
BOMBS = [
    r"\boxed{9^{9^{9^{9}}}}",
    r"\boxed{(10^{10^{10}})!}",
    r"\boxed{((9^{9999})^{9999})^{9999}}",  # each exponent small, the value not
    r"\boxed{x^{9^{99}}}",
    "<answer>9^9^9^9^9</answer>",
]

RAW = """
from math_verify import parse, verify
from molt_hpc.agents import Env, Result

class RawVerify(Env):
    # math-verify with its signal timeout off (as in any worker thread) and none of the grader's bounds
    def step(self, state):
        gold, got = parse("$1$", parsing_timeout=None), parse(state["action_text"], parsing_timeout=None)
        return Result(reward=float(verify(gold, got, timeout_seconds=None)), terminated=True)
"""


async def _step(pool: EnvWorkerPool, text: str, label: str = "1"):
    state = State(prompt="p", label=label)
    episode = await pool.open(state)
    await episode.reset(state)
    state.action_text = text
    return await episode.step(state)


@pytest.mark.parametrize("answer", BOMBS)
def test_exploding_answers_score_zero_unevaluated(answer: str) -> None:
    grade(r"\boxed{1}", "1")  # imports sympy and math-verify outside the clock
    start = time.monotonic()
    assert grade(answer, "1") == (0.0, {"answers": 1.0, "missing_answer": 0.0, "correct": 0.0})
    assert time.monotonic() - start < 10.0  # unbounded when evaluated


def test_ten_megabyte_replies_grade_in_seconds() -> None:
    replies = ["<answer>" + "9" * TEN_MB + "</answer>", r"\boxed{" * (TEN_MB // 7), "<answer>" * (TEN_MB // 8)]
    for reply in replies:
        start = time.monotonic()
        assert grade(reply, "1")[0] == 0.0
        assert time.monotonic() - start < 15.0
    assert grade("x" * TEN_MB + r" \boxed{1}", "1")[0] == 1.0  # a long reply with a good answer still counts


def test_pathological_answers_in_env_workers_fail_nothing_else() -> None:
    async def go():
        pool = EnvWorkerPool(str(ROOT / "envs" / "math.py"), 2, 30.0)  # rollout.env_timeout_s's default
        await pool.ready()
        try:
            texts = ["<answer>" + "1" * TEN_MB + "</answer>", *BOMBS, r"\boxed{1}"]
            return await asyncio.gather(*(_step(pool, t) for t in texts)), dict(pool.counts)
        finally:
            await pool.close()

    results, counts = asyncio.run(asyncio.wait_for(go(), 100))
    assert [r.reward for r in results] == [0.0] * (1 + len(BOMBS)) + [1.0]
    assert counts.get("env_workers_replaced_total", 0) == 0  # graded, not killed


def test_what_gets_past_the_bounds_costs_at_most_the_env_timeout(tmp_path) -> None:
    spec = tmp_path / "raw.py"
    spec.write_text(RAW)

    async def go():
        pool = EnvWorkerPool(str(spec), 2, TIMEOUT_S)
        await pool.ready()
        try:
            start = time.monotonic()
            outcomes = await asyncio.gather(_step(pool, r"$9^{9^{9^{9}}}$"), _step(pool, "$1$"), return_exceptions=True)
            return outcomes, time.monotonic() - start, dict(pool.counts)
        finally:
            await pool.close()

    (bomb, fine), waited, counts = asyncio.run(asyncio.wait_for(go(), 100))
    assert isinstance(bomb, EnvError) and bomb.reason == "timeout"
    assert fine.reward == 1.0
    assert TIMEOUT_S <= waited < TIMEOUT_S + 10
    assert counts["env_workers_replaced_total"] == 1
