"""The chat endpoint's answers in OpenAI's shapes: a `chat.completion` of n choices and its parts.

A choice's text is the reply decoded with special tokens skipped (after the forced tool-call opening, if
any), read for tool calls by `rollout.tool_parser` when the request offered tools. Its `logprobs.content`
lists every token the engine produced (its stop token too) with the engine's log-prob, the number the
trace trains with, and, with `top_logprobs` k, the k most likely tokens of that step as the engine
reported them (processed: after temperature, top-k and top-p, like the sampled token's).
"""

import hashlib
import time
import uuid
from dataclasses import dataclass
from typing import Any

from molt_hpc.rollout.tool_calls import parse_reply

SEED_RANGE = 2**31
"""Seeds derived for choices after the first stay below this (every engine's generator takes them)."""


@dataclass(frozen=True)
class Turn:
    """One checked request, ready for the engines."""

    req: Any
    """The `ChatRequest`."""
    session: str
    prompt_ids: list[int]
    """The rendered conversation (and a forced tool-call opening), as the engines get it."""
    prefix: str
    """The forced tool-call opening: the start of every choice's text."""
    params: list[dict[str, Any]]
    """The sampling params of each choice (n of them)."""


def choice_seed(seed: int | None, index: int) -> int | None:
    """The sampling seed of choice `index` of a seeded request: the request's own for the first (so n = 1
    samples as before), a reproducible other one for each next (the same seed would repeat the first)."""
    if seed is None or index == 0:
        return seed
    digest = hashlib.sha256(f"{seed}:choice:{index}".encode()).digest()
    return int.from_bytes(digest[:4], "little") % SEED_RANGE


def token_entry(tokenizer: Any, token_id: int, logprob: float) -> dict[str, Any]:
    """One token as OpenAI's log-prob entries show it: its text, log-prob and UTF-8 bytes."""
    piece = tokenizer.decode([token_id])
    return {"token": piece, "logprob": float(logprob), "bytes": list(piece.encode())}


def logprob_content(tokenizer: Any, out: Any, top: int, start: int = 0) -> list[dict[str, Any]]:
    """OpenAI's `logprobs.content` of `out`'s tokens from `start` on; `top`: how many alternatives each."""
    alternatives = (out.top_logprobs or []) if top else []
    entries = []
    for i in range(start, len(out.token_ids)):
        entry = token_entry(tokenizer, out.token_ids[i], out.logprobs[i])
        steps = alternatives[i] if i < len(alternatives) else []
        entry["top_logprobs"] = [token_entry(tokenizer, t, lp) for t, lp in steps[:top]]
        entries.append(entry)
    return entries


def reply_text(tokenizer: Any, prefix: str, token_ids: list[int]) -> str:
    return prefix + tokenizer.decode(token_ids, skip_special_tokens=True)


def reply_message(tokenizer: Any, parser: str, req: Any, prefix: str, out: Any) -> tuple[dict[str, Any], str]:
    """(message, finish reason) of one choice: the text, or its tool calls when it made well-formed ones."""
    text = reply_text(tokenizer, prefix, out.token_ids)
    parsed = parse_reply(parser, text, req.offered, req.choice, req.choice_name)
    if parsed is None:
        return {"role": "assistant", "content": text}, out.finish_reason
    content, calls = parsed
    return {"role": "assistant", "content": content, "tool_calls": [c.openai() for c in calls]}, "tool_calls"


def usage(prompt_len: int, outs: list[Any]) -> dict[str, int]:
    """Token counts: the prompt once, the completion tokens of every choice."""
    completion = sum(len(out.token_ids) for out in outs)
    return {"prompt_tokens": prompt_len, "completion_tokens": completion, "total_tokens": prompt_len + completion}


def completion(
    tokenizer: Any, parser: str, req: Any, prefix: str, outs: list[Any], prompt_len: int, model: str
) -> dict[str, Any]:
    """The whole answer: one choice per completion, in order."""
    choices = []
    for index, out in enumerate(outs):
        message, finish = reply_message(tokenizer, parser, req, prefix, out)
        choice: dict[str, Any] = {"index": index, "message": message, "finish_reason": finish}
        if req.logprobs:
            choice["logprobs"] = {"content": logprob_content(tokenizer, out, req.top_logprobs or 0)}
        choices.append(choice)
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage(prompt_len, outs),
    }
