"""`stream: true` on the chat endpoint: the reply as OpenAI's `chat.completion.chunk` server-sent events.

Every choice opens with a chunk naming the assistant role. A plain reply's text then goes out as the
engine samples it (each choice's chunks carry its `index`; with `logprobs: true`, each chunk the log-probs
of its tokens), decoded whole at each step so a character split over tokens waits for its last byte.
A reply that must be read whole first comes in one content chunk at its end: one that may hold tool
calls (the request offered tools and `rollout.tool_parser` reads them) is parsed there and its calls
follow as `delta.tool_calls`, and one asked for `top_logprobs` (a streamed token comes without its
alternatives). Then each choice's finish reason, the usage when `stream_options.include_usage` asks, and
`data: [DONE]`. An engine failure after the first chunk is an `error` event (OpenAI's streamed error,
which its client raises), and nothing of the request is recorded. The calls are recorded as for a whole
answer, once every choice has finished.
"""

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from molt_hpc.agents.calls import EngineError
from molt_hpc.engine.client import EngineHTTPError
from molt_hpc.rollout.chat_answer import Turn, logprob_content, reply_message, reply_text, token_entry, usage

DONE = b"data: [DONE]\n\n"


def sse(data: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(data).encode() + b"\n\n"


def buffered(turn: Turn, parser: str) -> bool:
    """Whether the reply is sent whole at its end (tool calls to parse, or top log-probs to report)."""
    return bool(turn.req.top_logprobs) or (parser != "none" and turn.req.choice not in (None, "none"))


class ChoiceStream:
    """One choice of a streamed reply: what of its tokens and text has been sent."""

    def __init__(self, index: int, turn: Turn, tokenizer: Any):
        self.index, self.turn, self.tokenizer = index, turn, tokenizer
        self.count = 0
        """Tokens sent."""
        self.text = ""
        """Text sent."""

    def piece(self, token_ids: list[int], logprobs: list[float], final: bool = False) -> dict[str, Any] | None:
        """The chunk choice with the text and log-probs of the tokens past those sent (None: nothing new)."""
        new = list(token_ids[self.count :])
        if not new and not final:
            return None
        text = reply_text(self.tokenizer, self.turn.prefix, token_ids)
        delta = ""
        if text.startswith(self.text) and (final or not text.endswith("\ufffd")):
            delta, self.text = text[len(self.text) :], text
        entries = None
        if self.turn.req.logprobs:
            lps = logprobs[self.count :]
            content = [
                {**token_entry(self.tokenizer, t, lp), "top_logprobs": []} for t, lp in zip(new, lps, strict=True)
            ]
            entries = {"content": content}
        self.count = len(token_ids)
        return {"index": self.index, "delta": {"content": delta}, "logprobs": entries, "finish_reason": None}


class ChunkWriter:
    """The chunks of one streamed reply: a shared id, creation time and model."""

    def __init__(self, model: str):
        self.head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk",
                     "created": int(time.time()), "model": model}  # fmt: skip

    def chunk(self, *choices: dict[str, Any], **extra: Any) -> bytes:
        return sse({**self.head, "choices": list(choices), **extra})

    def opening(self, index: int) -> bytes:
        delta = {"role": "assistant", "content": ""}
        return self.chunk({"index": index, "delta": delta, "logprobs": None, "finish_reason": None})


def whole_choice(writer: ChunkWriter, tokenizer: Any, parser: str, turn: Turn, index: int, out: Any) -> list[bytes]:
    """A buffered choice's chunks: its content (with every token's log-probs), its tool calls, its finish."""
    message, finish = reply_message(tokenizer, parser, turn.req, turn.prefix, out)
    logprobs = {"content": logprob_content(tokenizer, out, turn.req.top_logprobs or 0)} if turn.req.logprobs else None
    chunks = [writer.chunk({"index": index, "delta": {"content": message["content"]}, "logprobs": logprobs,
                            "finish_reason": None})]  # fmt: skip
    if message.get("tool_calls"):
        calls = [{"index": k, **call} for k, call in enumerate(message["tool_calls"])]
        chunks.append(writer.chunk({"index": index, "delta": {"tool_calls": calls}, "logprobs": None,
                                    "finish_reason": None}))  # fmt: skip
    chunks.append(writer.chunk({"index": index, "delta": {}, "logprobs": None, "finish_reason": finish}))
    return chunks


async def stream_reply(
    server: Any, turn: Turn, generate_all: Callable[..., Any], failed: Callable[[Exception], dict[str, Any]]
) -> AsyncIterator[bytes]:
    """The reply's chunks. `generate_all(turn, listeners)` generates and records the choices (a listener per
    choice, or None); `failed(err)` is the OpenAI error body of a failed generation (its failure recorded)."""
    writer, tok, parser = ChunkWriter(server.model), server.tokenizer, server.cfg.tool_parser
    live = not buffered(turn, parser)
    streams = [ChoiceStream(i, turn, tok) for i in range(len(turn.params))]
    queue: asyncio.Queue = asyncio.Queue()
    listeners = [_listener(queue, i) if live else None for i in range(len(streams))]
    work = asyncio.ensure_future(generate_all(turn, listeners))
    work.add_done_callback(lambda _: queue.put_nowait(None))
    try:
        for i in range(len(streams)):
            yield writer.opening(i)
        while (item := await queue.get()) is not None:
            index, token_ids, logprobs = item
            if (piece := streams[index].piece(token_ids, logprobs)) is not None:
                yield writer.chunk(piece)
        try:
            outs = work.result()
        except (EngineError, EngineHTTPError) as err:
            yield sse(failed(err))
            yield DONE
            return
    finally:
        work.cancel()  # the client left mid-reply: stop generating for it
    for i, out in enumerate(outs):
        if live:
            yield writer.chunk(streams[i].piece(out.token_ids, out.logprobs, final=True))
            yield writer.chunk({"index": i, "delta": {}, "logprobs": None, "finish_reason": out.finish_reason})
        else:
            for chunk in whole_choice(writer, tok, parser, turn, i, out):
                yield chunk
    if turn.req.stream_options is not None and turn.req.stream_options.include_usage:
        yield writer.chunk(usage=usage(len(turn.prompt_ids), outs))
    yield DONE


def _listener(queue: asyncio.Queue, index: int) -> Callable[[list[int], list[float]], None]:
    return lambda token_ids, logprobs: queue.put_nowait((index, list(token_ids), list(logprobs)))
