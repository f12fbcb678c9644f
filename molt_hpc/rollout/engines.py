"""The orchestrator's link to the engine pool: generate through the router, and the engines' version.

Failures are sorted here: a lost connection, a timeout or a 5xx answer is an `EngineError` (the
sample is retried from its start; the router has failed over meanwhile); a 4xx answer means the
request itself is wrong (bad token, a prompt over `engines.max_model_len`), which no retry fixes,
so it propagates and stops the orchestrator with the engine's message. The router is restarted by
the engine pool when it dies, on a new port: a failed call re-reads `rendezvous/router.json`, so the
retried sample (and every later call) goes to the new router.
"""

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import aiohttp

from molt_hpc.agents.calls import EngineError
from molt_hpc.engine import client
from molt_hpc.log import get_logger
from molt_hpc.rundir import RunDir


def read_url(path: Path) -> str | None:
    """The `url` of a rendezvous file, or None while it is missing or being replaced."""
    try:
        return json.loads(path.read_text())["url"]
    except (FileNotFoundError, json.JSONDecodeError, KeyError):
        return None


async def wait_for_router(run: RunDir, timeout_s: float, stopping: asyncio.Event | None = None) -> str:
    """The router's URL once it has registered in `RUN_DIR/rendezvous/router.json`."""
    deadline = time.monotonic() + timeout_s
    logged = False
    while (url := read_url(run.rendezvous / "router.json")) is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"no router registered in {run.rendezvous / 'router.json'} within {timeout_s:.0f} s")
        if stopping is not None and stopping.is_set():
            raise asyncio.CancelledError
        if not logged:
            get_logger().info("waiting for the router to register in %s", run.rendezvous)
            logged = True
        await asyncio.sleep(0.2)
    return url


class EngineLink:
    """Generate calls through the router with the run's token; tracks the newest weight version seen."""

    def __init__(self, session: aiohttp.ClientSession, router_url: str, token: str, run: RunDir, timeout_s: float):
        self.session = session
        self.router_url = router_url
        self.token = token
        self.run = run
        self.timeout_s = timeout_s
        self.version = 0
        """Newest weight version any engine answered with."""
        self.generated_tokens = 0

    def follow_router(self) -> None:
        """Take the router's current address (it registers anew after a restart)."""
        url = read_url(self.run.rendezvous / "router.json")
        if url is not None and url != self.router_url:
            get_logger().info("the router moved to %s", url)
            self.router_url = url

    async def generate(
        self, token_ids: list[int], sampling_params: dict[str, Any], session_id: str, images: list | None = None
    ) -> Any:
        try:
            out = await client.generate(
                self.session,
                self.router_url,
                token_ids,
                sampling_params,
                token=self.token,
                session_id=session_id,
                timeout=self.timeout_s,
                images=images,
            )
        except client.EngineHTTPError as err:
            if err.status < 500:
                raise
            raise EngineError(str(err)) from err
        except (aiohttp.ClientError, TimeoutError) as err:  # the engine or router died or stalled: retried
            self.follow_router()
            raise EngineError(f"{type(err).__name__}: {err}") from err
        self.version = max(self.version, out.weight_version)
        self.generated_tokens += len(out.token_ids)
        return out

    async def wait_for_engines(self, stop: asyncio.Event, poll_s: float = 0.5, timeout_s: float | None = None) -> bool:
        """Whether the router has a healthy engine (engines load slower than the router starts), waiting up
        to `timeout_s`; False when the time ran out or `stop` was set first."""
        logged = False
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not stop.is_set():
            try:
                answer = await client.health(self.session, self.router_url, token=self.token, timeout=5.0)
                if int(answer.get("engines", 1)) > 0:
                    return True
            except client.EngineHTTPError as err:
                if err.status < 500:  # a refused token: waiting will not fix it
                    raise
            except (aiohttp.ClientError, TimeoutError):  # the router is restarting: ask again
                self.follow_router()
            if deadline is not None and time.monotonic() > deadline:
                return False
            if not logged:
                get_logger().info("waiting for a healthy engine behind the router")
                logged = True
            await asyncio.sleep(poll_s)
        return False

    async def poll_version(self) -> int:
        """Ask every registered engine for its weight version (when no response has told us lately)."""
        for path in sorted(self.run.rendezvous.glob("engine-*.json")):
            url = read_url(path)
            if url is None:
                continue
            try:
                answer = await client.health(self.session, url, token=self.token, timeout=2.0)
            except (aiohttp.ClientError, TimeoutError, client.EngineHTTPError):  # a restarting engine: ask the rest
                continue
            self.version = max(self.version, int(answer.get("weight_version", 0)))
        return self.version
