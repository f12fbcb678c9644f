"""The orchestrator's link to the engine pool: generate through the router, and the engines' version.

Failures are sorted here: a lost connection, a timeout, a 5xx or an aborted answer is continued
from the tokens already streamed (`molt_hpc.rollout.resume`: the router has failed over meanwhile),
and only a turn that keeps failing is an `EngineError` (its sample then starts again); a 4xx answer means the
request itself is wrong (bad token, a prompt over `engines.max_model_len`), which no retry fixes,
so it propagates and stops the orchestrator with the engine's message. The router is restarted by
the engine pool when it dies, on a new port: a failed call re-reads `rendezvous/router.json`, so the
retried sample (and every later call) goes to the new router.
"""

import asyncio
import json
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp

from molt_hpc.agents.calls import EngineError
from molt_hpc.engine import client, stream
from molt_hpc.engine.stream import Partial
from molt_hpc.log import get_logger
from molt_hpc.rollout.resume import Segments
from molt_hpc.rundir import RunDir

RESUMES = 20
"""Failed calls one turn survives (about a minute and a half of pauses) before its sample starts again."""


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

    def __init__(
        self,
        session: aiohttp.ClientSession,
        router_url: str,
        token: str,
        run: RunDir,
        timeout_s: float,
        resumes: int = RESUMES,
    ):
        self.session = session
        self.router_url = router_url
        self.token = token
        self.run = run
        self.timeout_s = timeout_s
        self.version = 0
        """Newest weight version any engine answered with."""
        self.generated_tokens = 0
        self.resumes = resumes
        """Failed calls one turn survives before it is an `EngineError`."""
        self.counts: Counter = Counter()
        self.streaming: dict[str, Partial] = {}
        """The tokens each session's call in flight has streamed so far."""

    def follow_router(self) -> None:
        """Take the router's current address (it registers anew after a restart)."""
        url = read_url(self.run.rendezvous / "router.json")
        if url is not None and url != self.router_url:
            get_logger().info("the router moved to %s", url)
            self.router_url = url

    async def generate(
        self,
        token_ids: list[int],
        sampling_params: dict[str, Any],
        session_id: str,
        images: list | None = None,
        on_tokens: Callable[[list[int], list[float]], None] | None = None,
    ) -> Any:
        """One turn's answer; a call that fails (the engine died, the request was aborted, a 5xx) is continued
        from the tokens it had streamed, on whichever engine the router picks, up to `self.resumes` times (at
        once after a call that brought tokens, else after a growing pause). Past them an `EngineError` (the
        sample then starts again from its prompt). `on_tokens` gets the turn's tokens so far (kept and
        streamed, with their log-probs) each time more arrive: what it saw is always the start of the answer."""
        segments = Segments(token_ids, sampling_params)
        try:
            progressed = False
            for failures in range(self.resumes + 1):
                if failures and not progressed:  # a call that brought tokens failed with its engine: go on at once
                    await asyncio.sleep(min(5.0, 0.05 * 2**failures))
                ids, params = segments.request()
                partial = self.streaming[session_id] = Partial()
                if on_tokens is not None:
                    partial.listener = lambda p: on_tokens(
                        segments.tokens + p.token_ids, segments.logprobs + p.logprobs
                    )
                try:
                    out = await self._call(ids, params, session_id, images, partial)
                except EngineError as err:
                    progressed = segments.keep(partial) > 0
                    get_logger().info("session %s: %s; continuing after %d tokens", session_id, err,
                                      len(segments.tokens))  # fmt: skip
                    last_error = err
                else:
                    if out.finish_reason != "abort":
                        return self._done(segments, segments.merged(out))
                    progressed = segments.keep(out) > 0
                    last_error = EngineError("the engine aborted the request")
                if (reason := segments.finished()) is not None:  # the kept tokens already end the turn
                    return self._done(segments, segments.merged(None, reason))
        finally:
            self.streaming.pop(session_id, None)
        raise EngineError(f"{last_error} ({self.resumes} continuations failed)", discarded=len(segments.tokens))

    def _done(self, segments: Segments, out: Any) -> Any:
        self.version = max(self.version, out.weight_version)
        self.generated_tokens += len(out.token_ids)
        self.counts["tokens_migrated"] += segments.carried
        self.counts["requests_migrated"] += segments.carried > 0
        return out

    def take_counts(self) -> dict[str, int]:
        """Tokens and requests continued on another engine since the last call (for the metrics record)."""
        counts = {"tokens_migrated": 0, "requests_migrated": 0, **self.counts}
        self.counts.clear()
        return counts

    async def _call(
        self, token_ids: list[int], params: dict[str, Any], session_id: str, images: list | None, partial: Partial
    ) -> Any:
        """One streamed call through the router (builtin engines and vLLM fronts both stream), its failures as
        `EngineError`."""
        try:
            return await stream.generate_streamed(self.session, self.router_url, token_ids, params, partial,
                                                  token=self.token, session_id=session_id, timeout=self.timeout_s,
                                                  images=images)  # fmt: skip
        except client.EngineHTTPError as err:
            if err.status < 500:
                raise
            raise EngineError(str(err)) from err
        except (aiohttp.ClientError, TimeoutError) as err:  # the engine or router died or stalled: continued
            self.follow_router()
            raise EngineError(f"{type(err).__name__}: {err}") from err

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
