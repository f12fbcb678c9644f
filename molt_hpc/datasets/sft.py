"""SFT rows: chat demonstrations → token ids with the trained replies marked.

Two row shapes (JSONL, one object a line; `id` and `tools` optional):

- `{"messages": [{"role": "system" | "user" | "assistant" | "tool", "content": str}, ...]}`: every
  assistant reply trains (`sft.train_on = "all"`) or only the last (`"last"`);
- `{"prompt": str | [messages], "completion": str | message | [messages]}`: the completion's assistant
  replies train, the prompt (few-shot replies included) is context.

The mask comes from the model's chat template (`molt_hpc.datasets.chat_mask`). A row with no reply to
train, or over `sft.max_tokens` (unless `on_overlong = "truncate"` keeps a whole reply), is a bad row.
"""

from collections import Counter
from dataclasses import dataclass
from typing import Any

from molt_hpc.config.stages import SftConfig
from molt_hpc.data import as_messages, message_problem
from molt_hpc.datasets.chat_mask import Encoded, ReplyMarkers, RowProblem, encode_chat
from molt_hpc.datasets.rows import fingerprint, read_rows


@dataclass(frozen=True)
class SftSample:
    """One demonstration: its token ids and the spans of the replies that train."""

    row_id: str
    token_ids: list[int]
    replies: list[tuple[int, int]]


def check_messages(messages: Any, what: str) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise RowProblem(f"{what!r} must be a non-empty list of chat messages")
    for msg in messages:
        if problem := message_problem(msg):
            raise RowProblem(problem)
    return messages


def completion_messages(completion: Any) -> list[dict[str, Any]]:
    """A completion (text, one message, or messages) as messages; it needs an assistant reply."""
    if isinstance(completion, str):
        return [{"role": "assistant", "content": completion}]
    msgs = check_messages([completion] if isinstance(completion, dict) else completion, "completion")
    if not any(m["role"] == "assistant" for m in msgs):
        raise RowProblem("the completion has no assistant message")
    return msgs


def row_chat(row: dict[str, Any], train_on: str) -> tuple[list[dict[str, Any]], list[bool]]:
    """(messages, which assistant messages train) of an SFT row."""
    if "messages" in row:
        msgs = check_messages(row["messages"], "messages")
        n = sum(m["role"] == "assistant" for m in msgs)
        return msgs, [train_on == "all" or k == n - 1 for k in range(n)]
    if "prompt" not in row or "completion" not in row:
        raise RowProblem("a row needs 'messages', or 'prompt' and 'completion'")
    prompt = row["prompt"]
    if isinstance(prompt, str):
        if not prompt.strip():
            raise RowProblem("'prompt' is empty")
        context = as_messages(prompt, None)
    else:
        context = check_messages(prompt, "prompt")
    reply = completion_messages(row["completion"])
    flags = [False] * sum(m["role"] == "assistant" for m in context)
    return [*context, *reply], flags + [m["role"] == "assistant" for m in reply if m["role"] == "assistant"]


def fit(enc: Encoded, max_tokens: int, truncate: bool) -> Encoded:
    """`enc` within `max_tokens`: as is, cut after its last whole reply that fits, or a bad row."""
    n = len(enc.token_ids)
    if n <= max_tokens:
        return enc
    kept = [(s, e) for s, e in enc.replies if e <= max_tokens]
    if not truncate or not kept:
        why = "no whole reply within it" if truncate else "set on_overlong = 'truncate' to cut it"
        raise RowProblem(f"too long ({n} tokens > max_tokens = {max_tokens}; {why})")
    return Encoded(enc.token_ids[: kept[-1][1]], kept)


class SftDataset:
    """The encoded rows of one SFT file."""

    def __init__(self, samples: list[SftSample], path: str, bad_rows: Counter):
        self.samples, self.path, self.bad_rows = samples, path, bad_rows
        self.key = fingerprint([s.row_id for s in samples])

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def lengths(self) -> list[int]:
        return [len(s.token_ids) for s in self.samples]

    @classmethod
    def load(cls, path: str, cfg: SftConfig, tokenizer: Any, markers: ReplyMarkers, limit: int | None = None):
        def parse(row: dict[str, Any], row_id: str) -> SftSample:
            msgs, trained = row_chat(row, cfg.train_on)
            enc = encode_chat(tokenizer, markers, msgs, trained, tools=row.get("tools"))
            enc = fit(enc, cfg.max_tokens, cfg.on_overlong == "truncate")
            return SftSample(row_id, enc.token_ids, enc.replies)

        samples, bad = read_rows(path, parse, cfg.on_bad_row, limit)
        return cls(samples, str(path), bad)
