"""Env calls in worker processes (`rollout.env_workers`): state kept per episode, a GIL-holding env that
cannot freeze the caller, only its own sample failed, the other episodes of a killed worker rebuilt.

Real worker processes throughout; the hanging env holds the GIL for real, with a catastrophically
backtracking regular expression (`(a+)+$` against a run of `a`s that ends in `b`: 2^40 steps).
"""

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from molt_hpc.agents.base import State
from molt_hpc.agents.calls import EnvError
from molt_hpc.agents.env_hosts import InProcessEnvs, worker_count
from molt_hpc.agents.env_workers import EnvWorkerPool
from molt_hpc.agents.loader import load_agent
from molt_hpc.agents.step_runner import StepEnvRunner
from molt_hpc.config import load_config
from molt_hpc.data import Position, Prompt
from molt_hpc.models import build_tiny_tokenizer
from molt_hpc.rollout.group import run_group
from tests.conftest import ROOT

pytestmark = pytest.mark.timeout(120)
TIMEOUT_S = 1.5

PROBE = """
import os
import random
import re

from molt_hpc.agents import Env, Result

class Probe(Env):
    def __init__(self):
        self.steps = 0  # per-episode state on the env object

    def reset(self, state):
        if state["label"] == "random":  # a different first observation each time: not deterministic
            return f"Guess: {random.random()}"
        if state["label"] == "lambda":
            return lambda: None  # cannot cross a process boundary
        return None

    def step(self, state):
        self.steps += 1
        action = state["action_text"]
        if action == "hang":
            re.match(r"(a+)+$", "a" * 40 + "b")  # holds the GIL for hours
        if action == "crash":
            os._exit(3)
        if action == "raise":
            raise KeyError("nope")
        if action == "none":
            return None
        info = {"label": state.get("label")}
        if state["label"] != "quiet":  # which process ran it (an answer that a rebuilt episode cannot repeat)
            info["pid"] = os.getpid()
        return Result(reward=float(self.steps), terminated=state["turn"] >= 1, observation="more", info=info)
"""


@pytest.fixture(scope="module")
def probe(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("envs") / "probe.py"
    path.write_text(PROBE)
    return str(path)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 100))


async def started(probe: str, workers: int = 2) -> EnvWorkerPool:
    pool = EnvWorkerPool(probe, workers, TIMEOUT_S)
    await pool.ready()
    return pool


async def step(episode, state: State, action: str, turn: int = 0):
    state.action_text, state.turn = action, turn
    return await episode.step(state)


def test_auto_worker_count_and_default() -> None:
    assert load_config(None).rollout.env_workers == "auto"
    assert 2 <= worker_count("auto") <= 8 and worker_count(0) == 0 and worker_count(5) == 5


def test_episodes_live_in_workers_and_keep_their_state(probe) -> None:
    async def go():
        pool = await started(probe)
        try:
            states = [State(prompt="p", label=f"l{i}") for i in range(4)]
            episodes = [await pool.open(s) for s in states]
            assert [await e.reset(s) for e, s in zip(episodes, states, strict=True)] == [None] * 4
            first = [await step(e, s, "ok") for e, s in zip(episodes, states, strict=True)]
            second = [await step(e, s, "ok", turn=1) for e, s in zip(episodes, states, strict=True)]
            homes = [e.worker.pid for e in episodes]
            for e in episodes:
                e.close()
            return first, second, homes, {w.pid for w in pool.slots}
        finally:
            await pool.close()

    first, second, homes, pids = run(go())
    assert len(pids) == 2 and os.getpid() not in pids
    assert sorted(homes) == sorted([*pids, *pids])  # spread over both workers, two episodes each
    for i, (one, two) in enumerate(zip(first, second, strict=True)):
        assert (one.reward, two.reward) == (1.0, 2.0)  # the env object lived on between the calls
        assert one.info == two.info == {"pid": homes[i], "label": f"l{i}"}
        assert (one.terminated, two.terminated) == (False, True)


def test_a_hung_call_fails_only_its_sample_and_never_freezes_the_caller(probe) -> None:
    async def go():
        pool = await started(probe)
        try:
            states = [State(prompt="p", label=x) for x in ("a", "b", "quiet")]
            hung, other, neighbour = [await pool.open(s) for s in states]
            for e, s in zip((hung, other, neighbour), states, strict=True):
                await e.reset(s)  # placed there, fewest episodes first: workers 0, 1, 0
            assert hung.worker is neighbour.worker is not other.worker
            killed = hung.worker
            assert (await step(neighbour, states[2], "ok")).reward == 1.0
            ticks = 0

            async def tick():
                nonlocal ticks
                while True:
                    ticks += 1
                    await asyncio.sleep(0.01)

            ticker = asyncio.create_task(tick())
            start = time.monotonic()
            with pytest.raises(EnvError) as err:
                await step(hung, states[0], "hang")
            waited = time.monotonic() - start
            ticker.cancel()
            # The others go on: one never left its worker, the neighbour is rebuilt on a live one.
            assert (await step(other, states[1], "ok")).reward == 1.0
            again = await step(neighbour, states[2], "ok", turn=1)
            return err.value, waited, ticks, killed, again, neighbour.worker, pool
        finally:
            await pool.close()

    err, waited, ticks, killed, again, home, pool = run(go())
    assert err.reason == "timeout" and "Env.step took longer than 1.5 s" in str(err)
    assert TIMEOUT_S <= waited < TIMEOUT_S + 5
    assert ticks >= 10  # the caller's event loop kept turning while the worker held its own GIL
    assert killed.dead and killed.proc.returncode == -9
    assert again.reward == 2.0 and home.pid != killed.pid  # rebuilt elsewhere by a replay: step 1, then step 2
    assert pool.counts["env_workers_replaced_total"] == 1 and pool.counts["env_episodes_rebuilt_total"] == 1


def test_a_frozen_worker_hands_on_its_waiting_calls_and_episodes(probe) -> None:
    """While a call holds its worker's GIL, the calls that worker has not begun, and its episodes between
    calls, go to another worker at once: they do not wait for the hung call's timeout."""

    async def go():
        pool = EnvWorkerPool(probe, 2, 60.0)
        await pool.ready()
        try:
            states = [State(prompt="p", label=x) for x in ("a", "b", "quiet", "c", "quiet")]
            hung, _, waiting, _, idle = episodes = [await pool.open(s) for s in states]
            for e, s in zip(episodes, states, strict=True):
                await e.reset(s)
            assert hung.worker is waiting.worker is idle.worker  # fewest episodes first: workers 0, 1, 0, 1, 0
            frozen = hung.worker
            hang = asyncio.create_task(step(hung, states[0], "hang"))
            while not any(c.started for c in frozen.pending.values()):
                await asyncio.sleep(0.01)
            sent = asyncio.create_task(step(waiting, states[2], "ok"))  # reaches the frozen worker, never begins
            while not frozen.pending or len(frozen.pending) < 2:
                await asyncio.sleep(0.01)
            answered = await sent
            moved = await step(idle, states[4], "ok")
            still_hung = not hang.done()
            hang.cancel()
            return answered, moved, waiting.worker, idle.worker, frozen, still_hung, dict(pool.counts)
        finally:
            await pool.close()

    answered, moved, home, other_home, frozen, still_hung, counts = run(go())
    assert still_hung and counts["env_workers_frozen_total"] == 1 and counts.get("env_workers_replaced_total", 0) == 0
    assert answered.reward == moved.reward == 1.0 and home is other_home is not frozen
    assert counts["env_episodes_rebuilt_total"] == 2


def test_a_cancelled_call_still_kills_its_hung_worker(probe) -> None:
    async def go():
        pool = await started(probe, workers=1)
        try:
            state = State(prompt="p", label="x")
            episode = await pool.open(state)
            await episode.reset(state)
            worker = episode.worker
            task = asyncio.create_task(step(episode, state, "hang"))
            while not worker.pending:
                await asyncio.sleep(0.01)
            task.cancel()  # its group failed, say: nobody waits for this call any more
            episode.close()
            while pool.counts["env_workers_replaced_total"] == 0:
                await asyncio.sleep(0.05)
            fresh = await pool.open(State(prompt="p", label="y"))
            await fresh.reset(State(prompt="p", label="y"))
            return worker, await step(fresh, State(prompt="p", label="y"), "ok"), fresh.worker
        finally:
            await pool.close()

    killed, result, fresh = run(go())
    assert killed.dead and killed.proc.returncode == -9
    assert result.info["pid"] == fresh.pid != killed.pid


def test_errors_read_as_they_do_in_process(probe) -> None:
    env_cls = load_agent(probe)

    async def errors(host) -> list[str]:
        out = []
        for label, action in (("x", "raise"), ("x", "none"), ("lambda", None)):
            state = State(prompt="p", label=label)
            episode = await host.open(state)
            try:
                value = await episode.reset(state)
                if action is not None:
                    value = await step(episode, state, action)
                out.append(f"ok {type(value).__name__}")
            except EnvError as err:
                out.append(f"{err.reason}|{err}")
            finally:
                episode.close()
        return out

    async def go():
        pool = await started(probe, workers=1)
        try:
            return await errors(pool), await errors(InProcessEnvs(env_cls, TIMEOUT_S))
        finally:
            await pool.close()

    in_workers, in_process = run(go())
    assert in_workers[0] == in_process[0] == "raised|raised: Env.step raised KeyError: 'nope'"
    assert in_workers[1] == "api|api: Env.step returned NoneType, not a Result"
    assert in_process[1] == "ok NoneType"  # the runner refuses it, with the same message (tests/test_agents.py)
    assert in_workers[2].startswith("api|api: Env.reset returned a function that cannot be pickled")
    assert in_process[2] == "ok function"


def test_a_call_that_kills_its_worker_twice_fails_its_sample(probe) -> None:
    async def go():
        pool = await started(probe)
        try:
            state = State(prompt="p", label="x")
            episode = await pool.open(state)
            await episode.reset(state)
            with pytest.raises(EnvError) as err:
                await step(episode, state, "crash")
            survivor = await pool.open(state)  # the pool goes on with fresh workers
            await survivor.reset(state)
            return err.value, await step(survivor, state, "ok"), pool.counts
        finally:
            await pool.close()

    err, result, counts = run(go())
    assert err.reason == "crashed" and "died 2 times" in str(err)
    assert result.reward == 1.0 and counts["env_workers_replaced_total"] == 2


def test_a_worker_that_cannot_load_the_agent_is_a_clear_error(tmp_path: Path) -> None:
    chat = tmp_path / "chat.py"
    chat.write_text("from molt_hpc.agents import ChatAgent\nclass C(ChatAgent):\n    async def run(self, ctx):\n"
                    "        return 1.0\n")  # fmt: skip
    for spec, message in ((str(tmp_path / "gone.py"), "not found"), (str(chat), "declares C, not an Env")):

        async def go(spec=spec):
            pool = EnvWorkerPool(spec, 1, TIMEOUT_S)
            try:
                await pool.open(State(prompt="p", label="x"))
            finally:
                await pool.close()

        with pytest.raises(RuntimeError, match=message) as err:
            run(go())
        assert "could not start" in str(err.value) and "rollout.env_workers = 0" in str(err.value)


ORPHAN = """
import asyncio, sys
from molt_hpc.agents.base import State
from molt_hpc.agents.env_workers import EnvWorkerPool

async def main():
    pool = EnvWorkerPool(sys.argv[1], 2, 600.0)
    await pool.ready()
    state = State(prompt="p", label="x", action_text="hang")
    episode = await pool.open(state)
    await episode.reset(state)
    asyncio.create_task(episode.step(state))
    while not episode.worker.pending:
        await asyncio.sleep(0.01)
    print(*(w.pid for w in pool.slots), flush=True)
    await asyncio.sleep(600)

asyncio.run(main())
"""


def test_workers_die_with_their_orchestrator_even_when_hung(probe) -> None:
    proc = subprocess.Popen([sys.executable, "-c", ORPHAN, probe], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(x) for x in proc.stdout.readline().split()]
        assert len(pids) == 2
    finally:
        proc.kill()  # SIGKILL: no cleanup of its own runs
        proc.wait()
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in pids):
        assert time.monotonic() < deadline, "an env worker outlived its orchestrator"
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"  # a zombie is dead, only not reaped yet
    except FileNotFoundError:
        return False


def scripted(pool: EnvWorkerPool, tok, samples: int):
    """A stand-in policy: sample s0's first attempt answers `hang` once every sample has been reset (has
    asked for its turn); every other answer is `ok`, given only once that hang has cost its worker, so
    that the other episodes are alive, between calls, when it is killed."""
    asked = []

    async def generate(token_ids, params, session_id):
        asked.append(session_id)
        if session_id.endswith(".s0.a0"):
            while len(asked) < samples:
                await asyncio.sleep(0.02)
            text = "hang"
        else:
            while pool.counts["env_workers_replaced_total"] == 0:
                await asyncio.sleep(0.02)
            text = "ok"
        ids = tok(text, add_special_tokens=False)["input_ids"]
        return SimpleNamespace(token_ids=ids, logprobs=[-0.5] * len(ids), weight_versions=[0] * len(ids),
                               finish_reason="stop")  # fmt: skip

    return generate


@pytest.mark.parametrize(("label", "restarts"), [("quiet", 0), ("random", 1)])
def test_a_group_survives_a_hung_sample(probe, label, restarts) -> None:
    """Through the real runner and the group's fault policy: the hung sample is retried, its neighbour on
    the killed worker is rebuilt (a deterministic env) or started again (one that is not)."""
    tok = build_tiny_tokenizer()
    cfg = load_config(None, ["rollout.n_samples=4", "rollout.on_env_error=retry", f"rollout.env_timeout_s={TIMEOUT_S}",
                             "rollout.max_turns=1"]).rollout  # fmt: skip

    async def go():
        pool = await started(probe)
        try:
            generate = scripted(pool, tok, cfg.n_samples)
            runner = StepEnvRunner(load_agent(probe), tok, cfg, generate, apply_chat_template=False, envs=pool)
            prompt = Prompt("p0", 0, "Say ok", label, tok("Say ok", add_special_tokens=False)["input_ids"])
            return await run_group(runner, prompt, Position(0, 0), cfg), pool.counts
        finally:
            await pool.close()

    outcome, counts = run(go())
    assert outcome.failure is None and dict(outcome.env_errors) == {"timeout": 1} and outcome.env_retries == 1
    assert outcome.env_restarts == restarts
    assert [s.reward for s in outcome.group.samples] == [1.0] * 4
    assert counts["env_workers_replaced_total"] == 1
    # s2 shared the killed worker with s0 (fewest episodes first: s0, s1, s2, s3 on workers 0, 1, 0, 1).
    assert counts["env_episodes_rebuilt_total"] == 1


def test_the_tiny_config_runs_its_env_in_workers() -> None:
    text = (ROOT / "configs" / "tiny_cpu.toml").read_text()
    assert "env_workers" not in text  # the default applies: the embedded demo runs envs in workers
    assert worker_count(load_config(ROOT / "configs" / "tiny_cpu.toml").rollout.env_workers) >= 2
