"""`EnvWorkerPool`: env construction, `reset` and `step` in worker processes (`rollout.env_workers`).

`rollout.env_workers` processes (`env_worker.py`, spawned: fresh interpreters) start once, in the
background (`start()`, while the engines load). An episode lives in one worker, which holds its env
object and state; every call of the episode goes there. What can go wrong, and what it costs:

- **A call past `env_timeout_s`** kills its worker: that sample fails with `EnvError("timeout")`
  (`env_errors_timeout`) and a fresh worker is spawned into the slot. The clock is the worker's, not
  the caller's: a call whose caller was cancelled (its group failed) still ends a worker it hangs.
- **A frozen worker** (no frame from it for `FREEZE_S`: user code holds its GIL) takes no new episode;
  its calls that had not started go elsewhere at once, and its episodes move at their next call, so
  a hang costs its own sample, not every sample that shares its worker. It thaws when it speaks again.
- **Moving** an episode (its worker killed, dead or frozen) replays its calls so far on a live worker
  (construction with reset, one round trip as always, then the steps, with the same states). An env
  that answers a replayed call differently is not deterministic and cannot be rebuilt: its sample
  starts again (`EpisodeLost`).
- **A worker that dies by itself** (a crash in a C extension, `os._exit`) is replaced the same way; a
  call that meets the death of its worker twice fails its sample (`EnvError("crashed")`).
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
from typing import Any

from molt_hpc.agents.base import State
from molt_hpc.agents.calls import EnvError, EpisodeLost
from molt_hpc.agents.env_hosts import worker_count
from molt_hpc.agents.env_worker import BEAT_S, frame, read_frame
from molt_hpc.log import get_logger

__all__ = ["EnvWorkerPool", "worker_count"]

START_TIMEOUT_S = 120.0
"""A worker that has not loaded the agent by then (a busy node importing torch is far faster) stops the run."""
FREEZE_S = 1.0
"""Silence (no answer, no heartbeat: the worker sends one every `BEAT_S`) after which a worker counts as frozen."""
DEATHS_PER_CALL = 2
"""Deaths of its worker (not kills for other episodes' timeouts) one call survives."""
ROW_FIELDS = ("prompt", "label", "row")
"""State fields sent once, when an episode opens; the others are the runner's, sent with every call."""


class WorkerLost(Exception):
    """A call's worker is gone or frozen: `killed` (another call's timeout), `died` (by itself), `frozen`."""

    def __init__(self, cause: str):
        super().__init__(cause)
        self.cause = cause


@dataclass
class _Call:
    future: asyncio.Future
    timer: asyncio.TimerHandle
    what: str
    timeout_s: float
    started: bool = False
    """The worker has read it and begun to run it."""


class _Worker:
    """One worker process, seen from the orchestrator: its socket, its calls in flight and their clocks."""

    def __init__(self, pool: "EnvWorkerPool", slot: int):
        self.pool, self.slot = pool, slot
        self.proc: asyncio.subprocess.Process | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.pending: dict[int, _Call] = {}
        self.episodes: set[int] = set()
        self.ready = self.dead = self.frozen = False
        self.heard = 0.0
        """Loop time of its last frame."""
        self.reading: asyncio.Task | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def name(self) -> str:
        return f"env worker {self.slot} (pid {self.pid})"

    @property
    def usable(self) -> bool:
        return self.ready and not self.dead and not self.frozen

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
        self.heard = asyncio.get_running_loop().time()
        self.ready = True
        self.reading = asyncio.create_task(self._read(reader))

    async def _read(self, reader: asyncio.StreamReader) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                kind, *rest = await read_frame(reader)
                self.heard = loop.time()
                if self.frozen:
                    self.pool.thawed(self)
                if kind == "started":
                    if rest[0] in self.pending:
                        self.pending[rest[0]].started = True
                elif kind in ("ok", "err"):
                    self._answer(kind, rest[0], rest[1:])
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass
        if not self.dead:  # it closed its end by dying: wait for its exit code, for the log
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.proc.wait(), 5.0)
        self.pool.lost(self, "died")

    def _answer(self, kind: str, call_id: int, answer: list[Any]) -> None:
        call = self.pending.pop(call_id, None)
        if call is None:  # expired, or sent elsewhere while this worker was frozen
            return
        call.timer.cancel()
        if call.future.done():  # its caller was cancelled (its group failed)
            return
        if kind == "ok":
            call.future.set_result(answer[0])
        else:
            call.future.set_exception(EnvError(*answer))

    async def call(self, op: str, episode_id: int, payload: dict[str, Any], what: str) -> Any:
        if not self.usable:
            raise WorkerLost("frozen" if self.frozen else "killed")
        loop = asyncio.get_running_loop()
        call_id = next(self.pool.ids)
        # The clock belongs to the worker, not to the caller: a call whose caller was cancelled still
        # kills its worker if it never ends (a runaway regular expression would hold it forever).
        # `begin` is two user calls (construction, reset): each may take env_timeout_s.
        timeout = self.pool.timeout_s * (2 if op == "begin" else 1)
        timer = loop.call_later(timeout, self._expire, call_id)
        future = loop.create_future()
        self.pending[call_id] = _Call(future, timer, what, timeout)
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
        why = f"{call.what} took longer than {call.timeout_s:g} s"
        if not call.future.done():
            call.future.set_exception(EnvError("timeout", f"{why}; its env worker was killed and replaced"))
        self.pool.lost(self, "killed", why)

    def release_unstarted(self) -> int:
        """Fail the calls it has not begun (`frozen`): their callers send them to another worker."""
        moved = [cid for cid, call in self.pending.items() if not call.started]
        for cid in moved:
            call = self.pending.pop(cid)
            call.timer.cancel()
            if not call.future.done():
                call.future.set_exception(WorkerLost("frozen"))
        return len(moved)

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
        self.spec, self.timeout_s, self.size = spec, timeout_s, workers
        self.slots: list[_Worker] = []
        self.reaping: set[asyncio.Task] = set()
        """Waits for killed or dead workers' exit (asyncio's child watcher reaps them)."""
        self.starting: set[asyncio.Task] = set()
        self.watchdog: asyncio.Task | None = None
        self.changed = asyncio.Event()
        """Set when a worker becomes usable (started, thawed) or the pool fails: `pick` looks again."""
        self.failure: BaseException | None = None
        self.closed = False
        self.ids = itertools.count(1)
        self.counts: Counter = Counter()
        self.env_name = "Env"

    # -- workers --------------------------------------------------------------------------------------
    def start(self) -> None:
        """Spawn the workers in the background (idempotent; `open` calls it too)."""
        if not self.slots and not self.closed:
            self.slots = [self._spawn(slot) for slot in range(self.size)]
            self.watchdog = asyncio.create_task(self._watch())

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
            self.changed.set()

        task = asyncio.create_task(go())
        self.starting.add(task)
        task.add_done_callback(self.starting.discard)
        return worker

    async def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(BEAT_S)
            for worker in self.slots:
                # Only a call it has begun can hold its GIL; silence without one is the node being busy.
                busy = any(call.started for call in worker.pending.values())
                if worker.usable and busy and loop.time() - worker.heard > FREEZE_S:
                    worker.frozen = True
                    self.counts["env_workers_frozen_total"] += 1
                    moved = worker.release_unstarted()
                    get_logger().warning(
                        "%s silent for %.1f s (user code holding its GIL?): %d waiting call(s) and its %d "
                        "episode(s) move to other workers",
                        worker.name, loop.time() - worker.heard, moved, len(worker.episodes),
                    )  # fmt: skip

    def thawed(self, worker: _Worker) -> None:
        worker.frozen = False
        get_logger().info("%s answers again", worker.name)
        self.changed.set()

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
        if worker.proc is not None:
            reap = asyncio.create_task(worker.proc.wait())
            self.reaping.add(reap)
            reap.add_done_callback(self.reaping.discard)
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
        """The usable worker with the fewest episodes, once there is one."""
        self.start()
        while True:
            if self.failure is not None:
                raise self.failure
            if self.closed:
                raise RuntimeError("the env worker pool is closed")
            usable = [w for w in self.slots if w.usable]
            if usable:
                return min(usable, key=lambda w: len(w.episodes))
            self.changed.clear()
            await self.changed.wait()

    # -- episodes -------------------------------------------------------------------------------------
    async def open(self, state: State) -> "WorkerEpisode":
        """An episode of `state`'s row; its env is built in a worker with its `reset`, in one round trip."""
        await self.pick()  # the first worker up tells the env's name
        row = {f.name: getattr(state, f.name) for f in fields(State) if f.name in ROW_FIELDS}
        return WorkerEpisode(self, next(self.ids), row)

    def stats(self) -> dict[str, Any]:
        return {"env_workers": self.size, **self.counts}

    async def close(self) -> None:
        """Kill every worker and reap it."""
        self.closed = True
        self.changed.set()
        tasks = [*self.starting, *([self.watchdog] if self.watchdog else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for worker in self.slots:
            worker.kill()
        waits = [w.proc.wait() for w in self.slots if w.proc is not None]
        await asyncio.gather(*waits, *self.reaping, return_exceptions=True)


class WorkerEpisode:
    """One episode in a worker; its log of calls rebuilds it on another worker when its own is lost."""

    def __init__(self, pool: EnvWorkerPool, episode_id: int, row: dict[str, Any]):
        self.pool, self.id, self.row = pool, episode_id, row
        self.worker: _Worker | None = None
        self.log: list[tuple[str, dict[str, Any], str, Any]] = []

    async def reset(self, state: State) -> Any:
        assert not self.log, "an episode is reset once, first"
        payload = {"row": self.row, "state": _runner_fields(state)}
        return await self.call("begin", payload, f"{self.pool.env_name}() and Env.reset")

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
                if self.worker is None or not self.worker.usable:
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
        """Onto the least busy usable worker; an episode that lived elsewhere replays its calls there."""
        if self.worker is not None:
            self.worker.forget(self.id)  # a frozen worker that thaws drops its copy
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
