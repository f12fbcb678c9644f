"""The env worker process: runs the user's env construction, `reset` and `step` for the orchestrator.

Started by `molt_hpc.agents.env_workers` as `python -m molt_hpc.agents.env_worker FD PARENT_PID`, it
talks over its end of a socket pair in length-prefixed pickled frames (a private pair between two
processes of one run: nothing else can write to it). The first frame is `("init", agent spec, sys.path,
role)`; the worker loads the agent and answers `("ready", pid, env class name)` or `("failed",
message)`. Each later request `(call id, op, episode id, payload)` runs concurrently with the others,
as env calls do in the orchestrator (sync user code in its own daemon thread, coroutines on this
process's loop):

- `begin`: build the episode's `Env` and its `State` (payload `row`: the row's fields of the state),
  set the runner's fields (payload `state`) and call `reset`: one round trip;
- `step`: set the runner's fields of the state (payload) and call `step`;
- `close`: forget the episode (no answer).

The worker says `("started", call id)` before it runs a call, then `("ok", call id, value)` or
`("err", call id, reason, detail)`: the reason and detail of the `EnvError` the same call raises in
the orchestrator's own threads. It says `("beat",)` every `BEAT_S` while its loop turns: a silent
worker with a call begun is frozen (user code holds its GIL), and the calls it has not begun can go
elsewhere. Episodes live here between calls: their env objects and states are this process's. The
orchestrator kills a worker whose call passes `rollout.env_timeout_s`. The worker dies with the
orchestrator (PR_SET_PDEATHSIG on Linux; elsewhere when its socket reaches end of file).
"""

import asyncio
import os
import pickle
import socket
import struct
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from molt_hpc.agents.base import Env, Result, State
from molt_hpc.agents.calls import EnvError, call_user

HEADER = struct.Struct("!I")
BEAT_S = 0.2
"""Seconds between heartbeats."""
THREADS = 256
"""Most sync user calls one worker runs at once (envs that wait on I/O overlap, as in the orchestrator)."""


def frame(obj: Any) -> bytes:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(data)) + data


async def read_frame(reader: asyncio.StreamReader) -> Any:
    """The next frame; `asyncio.IncompleteReadError` once the other end has gone."""
    (size,) = HEADER.unpack(await reader.readexactly(HEADER.size))
    return pickle.loads(await reader.readexactly(size))


class EnvHostProcess:
    """The episodes of this worker and the calls on them."""

    def __init__(self, env_cls: type[Env], writer: asyncio.StreamWriter):
        self.env_cls = env_cls
        self.writer = writer
        self.episodes: dict[int, tuple[Env, State]] = {}
        self.beginning: set[int] = set()
        """Episodes whose `begin` runs; a `close` that overtakes it drops the episode when it is built."""
        self.dropped: set[int] = set()
        # Reused threads for sync user code (a thread per call costs more than most env steps).
        self.threads = ThreadPoolExecutor(max_workers=THREADS, thread_name_prefix="user")

    async def handle(self, call_id: int, op: str, episode_id: int, payload: dict[str, Any]) -> None:
        if op == "close":
            if self.episodes.pop(episode_id, None) is None and episode_id in self.beginning:
                self.dropped.add(episode_id)
            return
        what = "Env.reset" if op == "begin" else f"Env.{op}"
        try:
            reply = ("ok", call_id, await self.run(op, episode_id, payload, what))
        except EnvError as err:
            reply = ("err", call_id, err.reason, err.detail)
        try:
            data = frame(reply)
        except Exception as err:  # the env's answer cannot cross the process boundary: this sample's API error
            kind = type(reply[2]).__name__
            data = frame(("err", call_id, "api", f"{what} returned a {kind} that cannot be pickled ({err})"))
        self.writer.write(data)

    async def run(self, op: str, episode_id: int, payload: dict[str, Any], what: str) -> Any:
        if op == "begin":  # construction and reset in one round trip
            name = f"{self.env_cls.__name__}()"
            self.beginning.add(episode_id)
            try:
                env = await call_user(self.env_cls, timeout=None, what=name, executor=self.threads)
            finally:
                self.beginning.discard(episode_id)
            if episode_id in self.dropped:  # closed while it was being built: nobody waits for it
                self.dropped.discard(episode_id)
                raise EnvError("closed", f"episode {episode_id} was closed while it was being built")
            self.episodes[episode_id] = (env, State(**payload["row"]))
            payload = payload["state"]
        assert op in ("begin", "step"), op
        if episode_id not in self.episodes:  # an invariant of the orchestrator; failing the sample beats a hang
            raise EnvError("lost", f"env worker {os.getpid()} holds no episode {episode_id}")
        env, state = self.episodes[episode_id]
        for key, value in payload.items():
            setattr(state, key, value)
        fn = env.reset if op == "begin" else env.step
        value = await call_user(fn, state, timeout=None, what=what, executor=self.threads)
        if op == "step" and not isinstance(value, Result):
            raise EnvError("api", f"Env.step returned {type(value).__name__}, not a Result")
        return value


async def beat(writer: asyncio.StreamWriter) -> None:
    while True:
        writer.write(frame(("beat",)))
        await asyncio.sleep(BEAT_S)


def load_env(spec: str) -> type[Env]:
    from molt_hpc.agents.loader import load_agent

    cls = load_agent(spec)
    if not issubclass(cls, Env):
        raise ValueError(f"rollout.agent = {spec!r} declares {cls.__name__}, not an Env: env workers run envs only")
    return cls


async def serve(sock: socket.socket) -> int:
    from molt_hpc.log import setup_logging

    reader, writer = await asyncio.open_connection(sock=sock)
    kind, spec, path, role = await read_frame(reader)
    assert kind == "init", kind
    log = setup_logging(role)
    sys.path[:] = path  # module-name agents import as they do in the orchestrator
    try:
        env_cls = load_env(spec)
    except Exception as err:  # reported to the orchestrator, which stops with it
        writer.write(frame(("failed", f"{type(err).__name__}: {err}")))
        await writer.drain()
        return 1
    writer.write(frame(("ready", os.getpid(), env_cls.__name__)))
    host = EnvHostProcess(env_cls, writer)
    running: set[asyncio.Task] = {asyncio.create_task(beat(writer))}
    while True:
        try:
            request = await read_frame(reader)
        except (asyncio.IncompleteReadError, ConnectionError):
            log.debug("the orchestrator closed its end; leaving")
            return 0
        if request[1] != "close":
            writer.write(frame(("started", request[0])))  # on the wire before any user code can take the GIL
        task = asyncio.create_task(host.handle(*request))
        running.add(task)  # held until done: the loop keeps only weak references to tasks
        task.add_done_callback(running.discard)


def die_with_parent(parent_pid: int) -> None:
    """Have the kernel kill this process when the orchestrator dies, even while user code holds the GIL."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != parent_pid:  # it died before the call above
        os._exit(0)


def main(argv: list[str] | None = None) -> int:
    fd, parent_pid = (int(x) for x in (argv or sys.argv[1:]))
    die_with_parent(parent_pid)
    return asyncio.run(serve(socket.socket(fileno=fd)))


if __name__ == "__main__":
    code = main()
    from molt_hpc.log import end_process

    end_process(code)  # user threads may still run (a call whose caller moved on): no interpreter teardown
