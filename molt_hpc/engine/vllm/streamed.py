"""A streamed generate through the vLLM front: vLLM's chunks passed on as the builtin engine's events.

With `stream: true` the front asks vLLM's `/inference/v1/generate` for a streamed answer: server-sent
`data: {...}` chunks (`request_id`, `choices[0]` with the chunk's `token_ids`, their log-probs in
`logprobs.content[i].logprob`, the `finish_reason` on the last one), then `data: [DONE]`. It passes
them on in the builtin engine's streamed format (`molt_hpc.engine.stream`): one event per chunk with
its `token_ids`, `logprobs` and `weight_versions`, then the whole answer, the JSON an unstreamed call
gets. Versions as for whole answers (`front.stamp_versions`): every token carries the version the
request started under, the answer's `weight_version` is the front's version when it ended, so a refit
that lands mid-request stamps the tokens with the oldest weights that may have produced them. A vLLM
that dies or errs mid-answer ends the stream with an error event and no answer: the caller keeps the
tokens it got and continues elsewhere (`molt_hpc.rollout.resume`). Under router replay the front does
not stream (`Front.routed`): vLLM's chunks may carry no routing.
"""

import json
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from molt_hpc.engine.stream import frames
from molt_hpc.protocol.edge import send

DONE = b"[DONE]"
EVENT_STREAM = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


class UpstreamBroke(RuntimeError):
    """vLLM's stream failed before its `[DONE]`: an error chunk, a malformed chunk or a cut connection."""


def sse(data: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(data).encode() + b"\n\n"


def chunk_message(chunk: dict[str, Any]) -> str | None:
    """The message of a vLLM error chunk (`{"error": {"message"}}`, or `{"object": "error", "message"}`), else None."""
    if chunk.get("object") == "error":
        return str(chunk.get("message", chunk))
    err = chunk.get("error")
    if err is None:
        return None
    return str(err.get("message", err)) if isinstance(err, dict) else str(err)


@dataclass
class Streamed:
    """What vLLM streamed of one request so far, stamped with the version it started under."""

    start: int
    request_id: str | None = None
    token_ids: list[int] = field(default_factory=list)
    content: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None

    def take(self, chunk: dict[str, Any]) -> dict[str, Any] | None:
        """Our event for one vLLM chunk (None for a chunk without tokens); an error or malformed chunk raises."""
        if (message := chunk_message(chunk)) is not None:
            raise UpstreamBroke(f"vLLM failed mid-answer after {len(self.token_ids)} tokens: {message}")
        self.request_id = self.request_id or chunk.get("request_id") or chunk.get("id")
        choices = chunk.get("choices") or []
        if not choices:  # a usage-only chunk
            return None
        if len(choices) != 1 or choices[0].get("index", 0) != 0:
            raise UpstreamBroke(f"vLLM streamed choices {[c.get('index') for c in choices]}; the front asks for one")
        choice = choices[0]
        ids = [int(t) for t in choice.get("token_ids") or []]
        content = list((choice.get("logprobs") or {}).get("content") or [])
        if len(content) != len(ids) or any("logprob" not in entry for entry in content):
            raise UpstreamBroke(f"a vLLM chunk of {len(ids)} tokens came with {len(content)} log-probs")
        self.finish_reason = choice.get("finish_reason") or self.finish_reason
        if not ids:
            return None
        self.token_ids += ids
        self.content += content
        lps = [float(entry["logprob"]) for entry in content]
        return {"token_ids": ids, "logprobs": lps, "weight_versions": [self.start] * len(ids)}

    def answer(self, now: int, rid: str) -> dict[str, Any]:
        """The whole answer, as `stamped_body` makes it of an unstreamed one."""
        choice: dict[str, Any] = {
            "index": 0,
            "token_ids": self.token_ids,
            "logprobs": {"content": self.content},
            "finish_reason": self.finish_reason or "stop",  # vLLM's default for a whole answer too
            "weight_versions": [self.start] * len(self.token_ids),
        }
        return {"id": self.request_id or rid, "choices": [choice], "weight_version": now}


async def relay_stream(
    request: web.Request, front: Any, upstream: aiohttp.ClientResponse, start: int
) -> web.StreamResponse:
    """Pass vLLM's streamed answer (`upstream`, a 2xx response) on as our events; see the module docstring."""
    streamed = Streamed(start)
    resp = web.StreamResponse(headers=EVENT_STREAM)
    await resp.prepare(request)
    try:
        await relay_chunks(upstream, streamed, resp)
        final = streamed.answer(front.version, f"gen-{front.index}")
    except (UpstreamBroke, aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, TimeoutError) as err:
        final = {"error": f"vLLM at {front.upstream} broke the stream after {len(streamed.token_ids)} tokens: {err}"}
    await send(resp, sse(final), end=True)
    return resp


async def relay_chunks(upstream: aiohttp.ClientResponse, streamed: Streamed, resp: web.StreamResponse) -> None:
    """Write our event of every vLLM chunk as it arrives, up to `[DONE]` (a stream that ends before it broke)."""
    if upstream.content_type != "text/event-stream":
        raise UpstreamBroke(f"vLLM answered a streamed request with {upstream.content_type}, not server-sent events")
    async for data in frames(upstream.content):
        if data.strip() == DONE:
            return
        try:
            chunk = json.loads(data)
        except json.JSONDecodeError as err:
            raise UpstreamBroke(f"a chunk that is not JSON: {data[:200]!r}") from err
        if (event := streamed.take(chunk)) is not None and not await send(resp, sse(event)):
            return  # the client left: the answer's end goes nowhere either
    raise UpstreamBroke("the stream ended without [DONE]")
