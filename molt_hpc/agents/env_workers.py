"""Where env code runs: the orchestrator's own threads (`rollout.env_workers = 0`) or worker processes.

`StepEnvRunner` calls an env host instead of the env: `await host.open(state)` builds an episode's
env, `await episode.reset(state)` and `await episode.step(state)` call it, `episode.close()` ends it.
Tokenising and generating stay in the orchestrator. Two hosts:

- `InProcessEnvs`: user code in daemon threads of the orchestrator (`call_user`). A call past
  `rollout.env_timeout_s` fails its sample, but code that holds the GIL (a runaway regular expression,
  a long C call) freezes the whole orchestrator, its clocks included.
- `EnvWorkerPool`: `rollout.env_workers` processes (`env_worker.py`, spawned: a fresh interpreter),
  started once in the background (`start()`, while the engines load). An episode lives in one worker,
  which holds its env object and state, and every call of the episode goes there. A call past
  `env_timeout_s` kills its worker: that sample fails with `EnvError("timeout")`
  (`env_errors_timeout`), a fresh worker is spawned into the slot, and each other episode of the killed
  worker moves to a live worker at its next call by replaying its calls so far (construction, reset,
  the steps, with the same states). An env that answers a replayed call differently is not
  deterministic and cannot be rebuilt: its sample starts again from its prompt (`EpisodeLost`). A
  worker that dies by itself (a crash in a C extension, `os._exit`) is replaced the same way; a call
  that meets the death of its worker twice fails its sample (`EnvError("crashed")`).
"""

import asyncio
import contextlib
import copy
import itertools
import os
import socket
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, fields
from typing import Any, Literal, Protocol

from molt_hpc.agents.base import Env, State
from molt_hpc.agents.calls import EnvError, EpisodeLost, call_user
from molt_hpc.agents.env_worker import frame, read_frame
from molt_hpc.log import get_logger

START_TIMEOUT_S = 120.0
"""A worker that has not loaded the agent by then (a busy node importing torch is far faster) stops the run."""
DEATHS_PER_CALL = 2
"""Deaths of its worker (not kills for other episodes' timeouts) one call survives."""
ROW_FIELDS = ("prompt", "label", "row")
"""State fields sent once, when an episode opens; the others are the runner's, sent with every call."""


def worker_count(setting: int | Literal["auto"]) -> int:
    """`rollout.env_workers` as a number: `auto` is one per 8 usable cores, at least 2 and at most 8."""
    if setting != "auto":
        return setting
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(2, min(8, cores // 8))


class Episode(Protocol):
    async def reset(self, state: State) -> Any: ...
    async def step(self, state: State) -> Any: ...
    def close(self) -> None: ...


class EnvHost(Protocol):
    async def open(self, state: State) -> Episode: ...


class InProcessEnvs:
    """Env calls in the orchestrator's threads (`rollout.env_workers = 0`)."""

    def __init__(self, env_cls: type[Env], timeout_s: float):
        self.env_cls, self.timeout_s = env_cls, timeout_s

    async def open(self, state: State) -> "InProcessEpisode":
        env = await call_user(self.env_cls, timeout=self.timeout_s, what=f"{self.env_cls.__name__}()")
        return InProcessEpisode(env, self.timeout_s)

    def stats(self) -> dict[str, Any]:
        return {}


class InProcessEpisode:
    def __init__(self, env: Env, timeout_s: float):
        self.env, self.timeout_s = env, timeout_s

    async def reset(self, state: State) -> Any:
        return await call_user(self.env.reset, state, timeout=self.timeout_s, what="Env.reset")

    async def step(self, state: State) -> Any:
        return await call_user(self.env.step, state, timeout=self.timeout_s, what="Env.step")

    def close(self) -> None:
        pass


class WorkerLost(Exception):
    """The worker of a call is gone: `killed` (for another call's timeout) or `died` (by itself)."""

    def __init__(self, cause: str):
        super().__init__(cause)
        self.cause = cause


@dataclass
class _Call:
    future: asyncio.Future
    timer: asyncio.TimerHandle
    what: str


class _Worker:
    """One worker process, seen from the orchestrator: its socket, its calls in flight and their clocks."""

    def __init__(self, pool: "EnvWorkerPool", slot: int):
        self.pool, self.slot = pool, slot
        self.proc: asyncio.subprocess.Process | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.pending: dict[int, _Call] = {}
        self.episodes: set[int] = set()
        self.ready = self.dead = False
        self.reading: asyncio.Task | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def name(self) -> str:
        return f"env worker {self.slot} (pid {self.pid})"

    async def start(self) -> None:
        ours, theirs = socket.socketpair()
        try:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "molt_hpc.agents.env_worker", str(theirs.fileno()), str(os.getpid()),
                stdin=subprocess.DEVNULL, pass_fds=(theirs.fileno(),),
            )  # fmt: skip
        finally:
            theirs.close()
        reader, self.writer = await asyncio.open_connection(sock=ours)
        self.writer.write(frame(("init", self.pool.spec, list(sys.path), f"env worker {self.slot}")))
        try:
            answer = await asyncio.wait_for(read_frame(reader), START_TIMEOUT_S)
        except (asyncio.IncompleteReadError, ConnectionError):
            answer = ("failed", f"it exited with code {await self.proc.wait()} before loading the agent")
        except TimeoutError:
            answer = ("failed", f"it did not load the agent within {START_TIMEOUT_S:g} s")
        if answer[0] != "ready":
            raise RuntimeError(
                f"{self.name} could not start: {answer[1]}; fix rollout.agent = {self.pool.spec!r}, or set "
                "rollout.env_workers = 0 to run the env in the orchestrator's process"
            )
        self.pool.env_name = answer[2]
        self.ready = True
        self.reading = asyncio.create_task(self._read(reader))

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                call_id, status, *answer = await read_frame(reader)
                call = self.pending.pop(call_id, None)
                if call is None:  # closed or expired already
                    continue
                call.timer.cancel()
                if call.future.done():  # its caller was cancelled (its group failed); the clock stopped
                    continue
                if status == "ok":
                    call.future.set_result(answer[0])
                else:
                    call.future.set_exception(EnvError(*answer))
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass
        if not self.dead:  # it closed its end by dying: wait for its exit code, for the log
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.proc.wait(), 5.0)
        self.pool.lost(self, "died")

    async def call(self, op: str, episode_id: int, payload: dict[str, Any], what: str) -> Any:
        if self.dead:
            raise WorkerLost("killed")
        loop = asyncio.get_running_loop()
        call_id = next(self.pool.ids)
        # The clock belongs to the worker, not to the caller: a call whose caller was cancelled still
        # kills its worker if it never ends (a runaway regular expression would hold it forever).
        timer = loop.call_later(self.pool.timeout_s, self._expire, call_id)
        future = loop.create_future()
        self.pending[call_id] = _Call(future, timer, what)
        assert self.writer is not None
        self.writer.write(frame((call_id, op, episode_id, payload)))
        return await future

    def forget(self, episode_id: int) -> None:
        self.episodes.discard(episode_id)
        if not self.dead and self.writer is not None:
            self.writer.write(frame((0, "close", episode_id, {})))

    def _expire(self, call_id: int) -> None:
        call = self.pending.pop(call_id, None)
        if call is None or self.dead:
            return
        why = f"{call.what} took longer than {self.pool.timeout_s:g} s"
        if not call.future.done():
            call.future.set_exception(EnvError("timeout", f"{why}; its env worker was killed and replaced"))
        self.pool.lost(self, "killed", why)

    def kill(self) -> None:
        self.dead = True
        for call in self.pending.values():
            call.timer.cancel()
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()
        if self.writer is not None:
            self.writer.close()


class EnvWorkerPool:
    """`workers` env worker processes for the agent `spec` (`rollout.agent`); see the module docstring."""

    def __init__(self, spec: str, workers: int, timeout_s: float):
        assert workers > 0
        self.spec, self.timeout_s = spec, timeout_s
        self.slots: list[_Worker] = []
        self.retired: list[_Worker] = []
        """Killed or dead workers, reaped at `close` (asyncio's child watcher has their exit codes by then)."""
        self.starting: set[asyncio.Task] = set()
        self.failure: BaseException | None = None
        self.closed = False
        self.ids = itertools.count(1)
        self.counts: Counter = Counter()
        self.size = workers
        self.env_name = "Env"

    def start(self) -> None:
        """Spawn the workers in the background (idempotent; `open` calls it too)."""
        if not self.slots and not self.closed:
            self.slots = [self._spawn(slot) for slot in range(self.size)]

    def _spawn(self, slot: int) -> _Worker:
        worker = _Worker(self, slot)

        async def go() -> None:
            try:
                await worker.start()
            except asyncio.CancelledError:
                worker.kill()
                raise
            except Exception as err:  # kept for `open`, which raises it: the run stops with the message
                worker.kill()
                self.failure = err

        task = asyncio.create_task(go())
        self.starting.add(task)
        task.add_done_callback(self.starting.discard)
        return worker

    def lost(self, worker: _Worker, cause: str, why: str = "") -> None:
        """A worker is gone (killed for `why`, or dead): fail its calls in flight, spawn its replacement."""
        if worker.dead or self.slots[worker.slot] is not worker:
            return
        code = worker.proc.returncode if worker.proc else None
        for call in list(worker.pending.values()):
            if not call.future.done():
                call.future.set_exception(WorkerLost(cause))
        worker.pending.clear()
        worker.kill()
        self.retired.append(worker)
        if self.closed:
            return
        self.counts["env_workers_replaced_total"] += 1
        what = f"killed: {why}" if cause == "killed" else f"died (exit code {code})"
        moving = len(worker.episodes)
        get_logger().warning("%s %s; its %d episode(s) move, a fresh worker starts", worker.name, what, moving)
        self.slots[worker.slot] = self._spawn(worker.slot)

    async def ready(self) -> None:
        """Wait until every worker is up (benchmarks and tests; `open` waits only for the first)."""
        self.start()
        while self.starting:
            await asyncio.wait(set(self.starting))
        if self.failure is not None:
            raise self.failure

    async def pick(self) -> _Worker:
        """The live worker with the fewest episodes, once one is up."""
        self.start()
        while True:
            if self.failure is not None:
                raise self.failure
            live = [w for w in self.slots if w.ready and not w.dead]
            if live:
                return min(live, key=lambda w: len(w.episodes))
            if self.closed or not self.starting:
                raise RuntimeError("the env worker pool is closed")
            await asyncio.wait(set(self.starting), return_when=asyncio.FIRST_COMPLETED)

    async def open(self, state: State) -> "WorkerEpisode":
        episode = WorkerEpisode(self, next(self.ids))
        payload = {f.name: getattr(state, f.name) for f in fields(State) if f.name in ROW_FIELDS}
        await self.pick()  # the first worker up tells the env's name
        await episode.call("open", payload, f"{self.env_name}()")
        return episode

    def stats(self) -> dict[str, Any]:
        return {"env_workers": self.size, **self.counts}

    async def close(self) -> None:
        """Kill every worker and reap it."""
        self.closed = True
        for task in list(self.starting):
            task.cancel()
        await asyncio.gather(*self.starting, return_exceptions=True)
        for worker in self.slots:
            worker.kill()
        procs = [w.proc for w in (*self.slots, *self.retired) if w.proc is not None]
        await asyncio.gather(*(p.wait() for p in procs), return_exceptions=True)


class WorkerEpisode:
    """One episode in a worker; its log of calls rebuilds it on another worker when its own is lost."""

    def __init__(self, pool: EnvWorkerPool, episode_id: int):
        self.pool, self.id = pool, episode_id
        self.worker: _Worker | None = None
        self.log: list[tuple[str, dict[str, Any], str, Any]] = []

    async def reset(self, state: State) -> Any:
        return await self.call("reset", _runner_fields(state), "Env.reset")

    async def step(self, state: State) -> Any:
        return await self.call("step", _runner_fields(state), "Env.step")

    def close(self) -> None:
        if self.worker is not None:
            self.worker.forget(self.id)
        self.log.clear()

    async def call(self, op: str, payload: dict[str, Any], what: str) -> Any:
        deaths = 0
        while True:
            try:
                if self.worker is None or self.worker.dead:
                    await self._place()
                assert self.worker is not None
                value = await self.worker.call(op, self.id, payload, what)
            except WorkerLost as lost:
                deaths += lost.cause == "died"
                if deaths >= DEATHS_PER_CALL:
                    raise EnvError("crashed", f"the env worker running {what} died {deaths} times") from None
                continue
            self.log.append((op, payload, what, value))
            return value

    async def _place(self) -> None:
        """Onto the least busy live worker; an episode that lived elsewhere replays its calls there."""
        if self.worker is not None:
            self.worker.episodes.discard(self.id)
        self.worker = await self.pool.pick()
        self.worker.episodes.add(self.id)
        if not self.log:
            return
        self.pool.counts["env_episodes_rebuilt_total"] += 1
        for op, payload, what, recorded in self.log:
            if await self.worker.call(op, self.id, payload, what) != recorded:
                raise EpisodeLost(
                    f"{what} answered differently when its episode was rebuilt on another env worker (the env "
                    "is not deterministic); the sample starts again from its prompt"
                )


def _runner_fields(state: State) -> dict[str, Any]:
    """A copy (the runner appends to `history` in place; a replay must send what this call sent)."""
    return copy.deepcopy({f.name: getattr(state, f.name) for f in fields(State) if f.name not in ROW_FIELDS})
