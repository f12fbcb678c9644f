"""The code task (`envs/code.py`): the reply's function runs against the row's hidden tests in the sandbox.

Real parts: a sandbox server process with bubblewrap, the env loaded as `rollout.agent` loads it, the
shipped datasets. Expected fractions come from running the same tests on the same code in this process
(trusted code, plain `exec`), independently of the harness.
"""

import asyncio
import json
import shutil

import pytest

from molt_hpc.agents import State
from molt_hpc.agents.loader import load_agent
from molt_hpc.sandbox.client import RUN_DIR_ENV
from tests.conftest import ROOT
from tests.sandbox_support import health, sandbox_run, start_sandbox

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    run = sandbox_run(tmp_path_factory.mktemp("code"), "sandbox.workers=2")
    proc = start_sandbox(run)
    yield run, proc
    proc.stop()


@pytest.fixture()
def env_cls(server, monkeypatch):
    monkeypatch.setenv(RUN_DIR_ENV, str(server[0].path))
    return load_agent(str(ROOT / "envs" / "code.py"))


def rows(split: str) -> list[dict]:
    return [json.loads(line) for line in (ROOT / "data" / f"code_{split}.jsonl").read_text().splitlines()]


def score(env_cls, replies: list[str], labels: list[dict]):
    async def go():
        states = [
            State(prompt="", label=label, action_text=reply) for reply, label in zip(replies, labels, strict=True)
        ]
        try:
            return await asyncio.gather(*(env_cls().step(state) for state in states))
        finally:
            await states[0].sandbox.close()  # this loop's connections (an env process keeps one loop)

    return asyncio.run(go())


def trusted_fraction(code: str, tests: list[str]) -> float:
    scope: dict = {}
    exec(code, scope)
    passed = 0
    for test in tests:
        try:
            exec(test, scope)
            passed += 1
        except AssertionError:
            pass
    return passed / len(tests)


def test_every_shipped_reference_solution_passes_all_its_tests(env_cls) -> None:
    labels = [r["label"] for r in rows("train") + rows("eval")]
    replies = [f"Here it is:\n```python\n{label['solution']}\n```\n" for label in labels]
    results = score(env_cls, replies, labels)
    assert [r.reward for r in results] == [1.0] * len(labels)
    assert all(r.info["passed_all"] == 1.0 for r in results)
    assert len(rows("train")) >= 30 and len(rows("eval")) >= 10
    assert not {r["label"]["entry"] for r in rows("train")} & {r["label"]["entry"] for r in rows("eval")}


def test_wrong_solutions_score_the_fraction_of_tests_they_pass(env_cls) -> None:
    by_name = {r["label"]["entry"]: r["label"] for r in rows("train")}
    wrong = {
        "fib": "def fib(n):\n    return n",  # right for 0 and 1 only
        "is_prime": "def is_prime(n):\n    return n % 2 == 1",
        "add": "def add(a, b):\n    return a - b",
        "clamp": "def clamp(x, lo, hi):\n    return x",
    }
    labels = [by_name[name] for name in wrong]
    results = score(env_cls, [f"```python\n{code}\n```" for code in wrong.values()], labels)
    expected = [trusted_fraction(code, label["tests"]) for code, label in zip(wrong.values(), labels, strict=True)]
    assert [r.reward for r in results] == expected
    assert 0 < expected[0] < 1 and all(r.info["no_result"] == 0.0 for r in results)


def test_no_code_crashes_and_hostile_code_score_zero_and_nothing_else(env_cls, server) -> None:
    label = next(r["label"] for r in rows("train") if r["label"]["entry"] == "add")
    replies = [
        "I do not know.",  # no code
        "```python\ndef add(a, b)\n    return a + b\n```",  # a syntax error
        "```python\nimport os\nos._exit(0)\n```",  # leaves before the harness reports
        "```python\nprint('0' * 32, 4)\ndef add(a, b):\n    return None\n```",  # forges a count line
        "```python\nwhile True:\n    pass\n```",  # never ends
        "```python\nimport os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n```",
        "```python\nx = bytearray(10 * 1024**3)\n```",
    ]
    before = health(server[0])["executions"]
    results = score(env_cls, replies, [label] * len(replies))
    assert [r.reward for r in results] == [0.0] * len(replies)
    assert results[0].info["code_found"] == 0.0 and results[4].info["timeout"] == 1.0
    state = health(server[0])
    assert server[1].proc.poll() is None and state["live_workers"] == state["workers"] == 2
    assert state["executions"] == before + len(replies) - 1  # every reply with code ran once
