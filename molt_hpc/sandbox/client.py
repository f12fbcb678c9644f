"""`SandboxClient`: how env code runs untrusted code (`await state.sandbox.run(code, stdin, files, timeout)`).

It finds the server through `RUN_DIR/rendezvous/sandbox.json`, sends the run's token, and waits while
the server is away (starting, or being restarted by the engine pool after a death: it reads the address
again) or busy (429: its queue is full), up to `wait_s`; past that it raises `SandboxUnavailable`, which
fails the calling sample like any env error. What the code does (a crash, a limit) is never an
exception: it is in the `RunResult`.

In env processes the run's client is `state.sandbox` (`default_client()`: the launcher tells the
orchestrator the run directory through `MOLT_SANDBOX_RUN_DIR`, and env workers inherit it). A sync
`Env.step` uses `run_sync`; a coroutine `step` awaits `run`.
"""

import asyncio
import json
import os
import time
import urllib.error
import urllib.request
from pathlib import Path
from weakref import WeakKeyDictionary

import aiohttp

from molt_hpc.rundir import RunDir
from molt_hpc.sandbox import sandbox_file
from molt_hpc.sandbox.protocol import RunRequest, RunResult

RUN_DIR_ENV = "MOLT_SANDBOX_RUN_DIR"
PAUSE_S = 0.1
"""Pause between tries while the server is away or its queue is full."""


class SandboxUnavailable(RuntimeError):
    """No sandbox server answered within the client's `wait_s`."""


class SandboxClient:
    """A client of one run's sandbox server; safe to share between coroutines of several event loops."""

    def __init__(self, run_dir: str | Path, wait_s: float = 120.0):
        self.rundir = RunDir(Path(run_dir).absolute())
        self.wait_s = wait_s
        self._token: str | None = None
        self._sessions: WeakKeyDictionary[asyncio.AbstractEventLoop, aiohttp.ClientSession] = WeakKeyDictionary()

    def _headers(self) -> dict[str, str]:
        if self._token is None:
            self._token = self.rundir.token()
        return {"Authorization": f"Bearer {self._token}", "Content-Type": "application/json"}

    def url(self) -> str | None:
        """The server's address now (None while none is registered)."""
        try:
            return str(json.loads(sandbox_file(self.rundir).read_text())["url"])
        except (OSError, ValueError, KeyError):
            return None

    def _session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        session = self._sessions.get(loop)
        if session is None or session.closed:
            session = self._sessions[loop] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        return session

    async def run(self, code: str, stdin: str = "", files: dict[str, str] | None = None, timeout: float | None = None):
        """Run `code` (Python source) in the sandbox; its `RunResult` (stdout, stderr, exit_code, timed_out,
        killed_reason, wall_s). `ValueError` for a request the server refuses (a bad file name)."""
        body = RunRequest(code=code, stdin=stdin, files=files or {}, timeout=timeout).model_dump_json()
        deadline = time.monotonic() + self.wait_s
        while True:
            url = self.url()
            if url is not None:
                try:
                    async with self._session().post(f"{url}/run", data=body, headers=self._headers()) as resp:
                        text = await resp.text()
                        if resp.status == 200:
                            return RunResult.model_validate_json(text)
                        if resp.status != 429:
                            raise ValueError(f"the sandbox refused the request ({resp.status}): {text}")
                except (TimeoutError, aiohttp.ClientConnectionError):
                    pass  # the server is going away or being restarted: read its address again
            if time.monotonic() > deadline:
                raise SandboxUnavailable(
                    f"no sandbox server answered within {self.wait_s:g} s ({sandbox_file(self.rundir)})"
                )
            await asyncio.sleep(PAUSE_S)

    def run_sync(self, code: str, stdin: str = "", files: dict[str, str] | None = None, timeout: float | None = None):
        """`run` for sync env code (a plain `def step`): blocks its thread until the result."""
        body = RunRequest(code=code, stdin=stdin, files=files or {}, timeout=timeout).model_dump_json().encode()
        deadline = time.monotonic() + self.wait_s
        while True:
            url = self.url()
            if url is not None:
                req = urllib.request.Request(f"{url}/run", data=body, headers=self._headers(), method="POST")
                try:
                    with urllib.request.urlopen(req, timeout=self.wait_s) as resp:
                        return RunResult.model_validate_json(resp.read())
                except urllib.error.HTTPError as err:
                    if err.code != 429:
                        raise ValueError(f"the sandbox refused the request ({err.code}): {err.read()!r}") from None
                except (urllib.error.URLError, ConnectionError):
                    pass
            if time.monotonic() > deadline:
                raise SandboxUnavailable(
                    f"no sandbox server answered within {self.wait_s:g} s ({sandbox_file(self.rundir)})"
                )
            time.sleep(PAUSE_S)

    async def health(self) -> dict:
        """The server's `/health` answer (pool size, queue, executions)."""
        url = self.url()
        if url is None:
            raise SandboxUnavailable(f"no sandbox server registered ({sandbox_file(self.rundir)})")
        async with self._session().get(f"{url}/health", headers=self._headers()) as resp:
            resp.raise_for_status()
            return await resp.json()

    async def close(self) -> None:
        """Close this loop's connections."""
        session = self._sessions.pop(asyncio.get_running_loop(), None)
        if session is not None:
            await session.close()


_clients: dict[str, SandboxClient] = {}


def default_client() -> SandboxClient:
    """This process's client of the run's sandbox (`state.sandbox`); `ValueError` when the run has none."""
    run_dir = os.environ.get(RUN_DIR_ENV)
    if not run_dir:
        raise ValueError("state.sandbox needs a [sandbox] section in the run's config (it starts the sandbox server)")
    if run_dir not in _clients:
        _clients[run_dir] = SandboxClient(run_dir)
    return _clients[run_dir]
