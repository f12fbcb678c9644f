"""A streamed generate call: the answer's tokens as they are sampled, kept when the call breaks.

`generate_streamed` asks an engine (or the router) for `stream: true` and reads the server-sent
events: each step's new `token_ids`, `logprobs` and `weight_versions`, then the whole answer (the
same JSON as an unstreamed call). Every token read lands in the caller's `Partial` at once, so a
connection that breaks mid-answer (the engine was killed, its job preempted) leaves the caller
holding every token the engine sent; `molt_hpc.rollout.resume` continues the request from them.
"""

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from molt_hpc.engine.client import (
    GENERATE_PATH,
    SESSION_HEADER,
    EngineHTTPError,
    GenerateResult,
    auth_headers,
    mm_field,
    parse_generate_response,
)


@dataclass
class Partial:
    """The tokens of one call read so far (with their log-probs and weight versions)."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    weight_versions: list[int] = field(default_factory=list)
    listener: Callable[["Partial"], None] | None = field(default=None, repr=False, compare=False)
    """Called after every event taken (a streamed chat reply passes the tokens on as they come)."""

    def add(self, delta: dict[str, Any]) -> bool:
        """Take one event's tokens; False (nothing taken) when its lists do not line up."""
        ids, lps, versions = list(delta["token_ids"]), list(delta["logprobs"]), list(delta["weight_versions"])
        if not len(ids) == len(lps) == len(versions):
            return False
        self.token_ids += [int(t) for t in ids]
        self.logprobs += [float(x) for x in lps]
        self.weight_versions += [int(v) for v in versions]
        if self.listener is not None:
            self.listener(self)
        return True


async def generate_streamed(
    session: aiohttp.ClientSession,
    url: str,
    token_ids: list[int],
    sampling_params: dict[str, Any],
    partial: Partial,
    *,
    token: str,
    session_id: str | None = None,
    timeout: float | None = None,
    images: list[Any] | None = None,
) -> GenerateResult:
    """Like `client.generate`, streamed: the answer, with every token also in `partial` as it came. A
    broken stream raises (`aiohttp.ClientError`, `TimeoutError`, or `EngineHTTPError` 502 for an error
    event or a stream that ended without its answer), `partial` keeping what arrived."""
    headers = {**auth_headers(token), **({SESSION_HEADER: session_id} if session_id else {})}
    body: dict[str, Any] = {"token_ids": list(token_ids), "sampling_params": sampling_params, "stream": True}
    if images:
        body["mm"] = mm_field(images)
    full = url.rstrip("/") + GENERATE_PATH
    kwargs: dict[str, Any] = {"json": body, "headers": headers}
    if timeout:
        kwargs["timeout"] = aiohttp.ClientTimeout(total=timeout)
    async with session.post(full, **kwargs) as resp:
        if resp.status >= 300:
            text = await resp.text()
            try:
                message = (json.loads(text) or {}).get("error", text)
            except (ValueError, AttributeError):  # not a JSON object (a proxy's page): keep the raw text
                message = text
            raise EngineHTTPError(resp.status, str(message), full)
        if resp.content_type != "text/event-stream":  # a server that answers whole completions only
            return parse_generate_response(await resp.json(content_type=None))
        async for event in events(resp.content):
            if "error" in event:
                raise EngineHTTPError(502, str(event["error"]), full)
            if "choices" in event:
                return parse_generate_response(event)
            if not partial.add(event):
                raise EngineHTTPError(502, "a streamed event's tokens, log-probs and versions differ in length", full)
    raise EngineHTTPError(502, f"the stream ended after {len(partial.token_ids)} tokens without its answer", full)


async def events(content: aiohttp.StreamReader):
    """The JSON of each `data:` event of a server-sent event stream."""
    async for data in frames(content):
        yield json.loads(data)


async def frames(content: aiohttp.StreamReader):
    """The payload of each `data:` event of a server-sent event stream, as bytes (events of any size: the
    answer's routing can run to megabytes, past a line reader's limit)."""
    buf = b""
    async for chunk in content.iter_any():
        start = max(0, len(buf) - 1)  # a separator can straddle two chunks; earlier bytes were searched
        buf += chunk
        while (end := buf.find(b"\n\n", start)) >= 0:
            frame, buf, start = buf[:end], buf[end + 2 :], 0
            if frame.startswith(b"data: "):
                yield frame[6:]
