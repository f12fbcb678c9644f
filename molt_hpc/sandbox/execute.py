"""One execution: start the confined `python3`, feed stdin, read capped output, enforce the wall clock.

The child gets its own session (process group); a wall-clock overrun, output past the cap, or a
cancelled request kills that group with SIGKILL (under bwrap, killing bwrap also ends its PID
namespace: every process the code made dies with it). The result says what ended it:
`killed_reason` is `timeout`, `output`, `memory`, `cpu` or None for a program that exited on its own.
"""

import asyncio
import contextlib
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

from molt_hpc.config.sandbox import SandboxConfig
from molt_hpc.sandbox import isolation
from molt_hpc.sandbox.protocol import RunRequest, RunResult

READ_CHUNK = 1 << 16
SWEEP_S = 10.0
"""Longest wait for a slot's processes to be gone after its execution."""
KILL_GRACE_S = 2.0
"""After a kill, how long the pipes may take to close before the output read so far is the answer."""


def _memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(name, 0)  # cloexec off: bwrap reads it after exec
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


async def _drain(stream: asyncio.StreamReader, out: bytearray, cap: int, over: asyncio.Event) -> None:
    """Up to `cap` bytes of `stream` into `out`; sets `over` (and stops reading) when the program writes more."""
    while True:
        chunk = await stream.read(READ_CHUNK)
        if not chunk:
            return
        out += chunk[: cap + 1 - len(out)]
        if len(out) > cap:
            del out[cap:]
            over.set()
            return


async def _feed(proc: asyncio.subprocess.Process, data: bytes) -> None:
    assert proc.stdin is not None
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # the program may never read it
        proc.stdin.write(data)
        await proc.stdin.drain()
    proc.stdin.close()


def _kill(proc: asyncio.subprocess.Process) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


async def _sweep(user: int | None) -> None:
    """Kill what is left of a slot's user id (processes that left the group, a PID namespace still being torn
    down) and wait until none is left: the slot's next execution starts with its whole process budget."""
    if user is None:
        return
    deadline = time.monotonic() + SWEEP_S
    while pids := isolation.pids_of(user):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):  # an orphan handed to this subreaper: reap it
                os.waitpid(pid, os.WNOHANG)
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes {pids} of sandbox user {user} survive SIGKILL")
        await asyncio.sleep(0.005)


def _reason(code: int, stderr: bytes) -> str | None:
    """Why a program that ended by itself failed, when a limit did it."""
    if code in (-signal.SIGXCPU, -signal.SIGKILL) or code == 128 + signal.SIGXCPU:
        return "cpu"
    if b"MemoryError" in stderr[-2000:]:
        return "memory"
    return None


async def _spawn(cfg: SandboxConfig, mode: str, req: RunRequest, limits: isolation.Limits, user: int | None, work: str):
    nproc = limits.max_procs + (isolation.own_tasks(os.getuid()) if user is None else 0)
    ids = {} if user is None else {"user": user, "group": user, "extra_groups": []}
    fds: list[int] = []
    try:
        if mode == "bwrap":
            code_fd = _memfd("main.py", req.code.encode())
            files = {name: _memfd(name, text.encode()) for name, text in req.files.items()}
            fds = [code_fd, *files.values()]
            argv, env, cwd = isolation.bwrap_argv(cfg, limits, code_fd, files), {}, "/"
        else:
            for name, text in req.files.items():
                Path(work, name).parent.mkdir(parents=True, exist_ok=True)
                Path(work, name).write_text(text)
            Path(work, ".main.py").write_text(req.code)
            if user is not None:  # the slot's own user id owns its directory and everything in it
                for root, dirs, names in os.walk(work):
                    for path in [root, *(os.path.join(root, n) for n in dirs + names)]:
                        os.chown(path, user, user)
            argv, env, cwd = [cfg.python, "-I", ".main.py"], isolation.rlimit_env(work), work
        return await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            env=env, cwd=cwd, pass_fds=fds, start_new_session=True, preexec_fn=isolation.preexec(limits, nproc),
            **ids,
        )  # fmt: skip
    finally:
        for fd in fds:
            os.close(fd)


async def execute(cfg: SandboxConfig, mode: str, req: RunRequest, user: int | None) -> RunResult:
    """Run `req` under `mode` isolation as the worker slot's user id `user` (None: this process's own); never
    raises for what the program does."""
    wall = min(req.timeout or cfg.timeout_s, cfg.timeout_s)
    limits = isolation.Limits(
        wall_s=wall, memory_bytes=cfg.memory_mb << 20, max_procs=cfg.max_procs,
        file_bytes=cfg.max_file_mb << 20, output_bytes=cfg.max_output_bytes,
    )  # fmt: skip
    work = tempfile.mkdtemp(prefix="molt-sandbox-") if mode == "rlimit" else ""
    start = time.monotonic()
    try:
        proc = await _spawn(cfg, mode, req, limits, user, work)
        over, stdout, stderr = asyncio.Event(), bytearray(), bytearray()
        assert proc.stdout is not None and proc.stderr is not None
        # Done when the program exited and its pipes closed: a program that closes its output and goes on
        # running is still under the wall clock.
        reads = asyncio.gather(
            _drain(proc.stdout, stdout, limits.output_bytes, over),
            _drain(proc.stderr, stderr, limits.output_bytes, over), _feed(proc, req.stdin.encode()), proc.wait(),
        )  # fmt: skip
        over_wait = asyncio.create_task(over.wait())
        try:
            done, _ = await asyncio.wait({reads, over_wait}, timeout=wall, return_when=asyncio.FIRST_COMPLETED)
            reason = "output" if over.is_set() else None if reads in done else "timeout"
            if reason is not None:
                _kill(proc)
                # A process that left the group (rlimit mode only) may hold the pipes: stop reading them.
                await asyncio.wait({reads}, timeout=KILL_GRACE_S)
            code = await proc.wait()
        finally:  # a cancelled request (its client went away) leaves nothing running
            over_wait.cancel()
            reads.cancel()
            _kill(proc)
            await _sweep(user)
        reason = reason or _reason(code, bytes(stderr))
        return RunResult(
            stdout=bytes(stdout).decode(errors="replace"), stderr=bytes(stderr).decode(errors="replace"),
            exit_code=code, timed_out=reason == "timeout", killed_reason=reason, wall_s=time.monotonic() - start,
        )  # fmt: skip
    finally:
        if work:
            shutil.rmtree(work, ignore_errors=True)
