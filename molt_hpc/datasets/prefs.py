"""Preference pairs for reward-model training: rows → (chosen tokens, rejected tokens, margin).

Row shape (JSONL; `id` optional): `{"prompt": str | [messages], "chosen": ..., "rejected": ...,
"margin": float?}`. With a prompt, `chosen` and `rejected` are its assistant continuations (text, a
message, or messages); without one, each is a whole conversation whose last assistant reply is the
one judged. Both sides are templated like SFT rows and end with the reply's stop token: the score is
read at the last token, as it is on a rollout trace (the same tokens a policy's rollout holds).
"""

from collections import Counter
from dataclasses import dataclass
from typing import Any

from molt_hpc.config.stages import RewardTrainConfig
from molt_hpc.data import as_messages
from molt_hpc.datasets.chat_mask import ReplyMarkers, RowProblem, encode_chat
from molt_hpc.datasets.rows import fingerprint, read_rows
from molt_hpc.datasets.sft import check_messages, completion_messages


@dataclass(frozen=True)
class Pair:
    """One preference: two token lists, each ending at its reply's stop token, and the margin."""

    row_id: str
    chosen: list[int]
    rejected: list[int]
    margin: float = 0.0

    @property
    def length(self) -> int:
        return len(self.chosen) + len(self.rejected)


def side_chat(row: dict[str, Any], side: str) -> list[dict[str, Any]]:
    """The conversation one side of a pair judges (its last assistant message is the reply)."""
    if side not in row:
        raise RowProblem(f"missing {side!r}")
    if "prompt" not in row:
        msgs = check_messages(row[side], side)
        if not any(m["role"] == "assistant" for m in msgs):
            raise RowProblem(f"{side!r} has no assistant message (without a 'prompt' each side is a whole chat)")
        return msgs
    prompt = row["prompt"]
    context = as_messages(prompt, None) if isinstance(prompt, str) else check_messages(prompt, "prompt")
    return [*context, *completion_messages(row[side])]


def encode_side(tokenizer: Any, markers: ReplyMarkers, msgs: list[dict[str, Any]], max_tokens: int, side: str):
    n = sum(m["role"] == "assistant" for m in msgs)
    ids = encode_chat(tokenizer, markers, msgs, [k == n - 1 for k in range(n)]).token_ids
    if len(ids) > max_tokens:
        raise RowProblem(f"too long ({side}: {len(ids)} tokens > max_tokens = {max_tokens})")
    return ids


class PreferenceDataset:
    """The encoded pairs of one preference file."""

    def __init__(self, pairs: list[Pair], path: str, bad_rows: Counter):
        self.pairs, self.path, self.bad_rows = pairs, path, bad_rows
        self.key = fingerprint([p.row_id for p in pairs])

    def __len__(self) -> int:
        return len(self.pairs)

    @property
    def lengths(self) -> list[int]:
        return [p.length for p in self.pairs]

    @classmethod
    def load(cls, path: str, cfg: RewardTrainConfig, tokenizer: Any, markers: ReplyMarkers, limit: int | None = None):
        def parse(row: dict[str, Any], row_id: str) -> Pair:
            chosen, rejected = (encode_side(tokenizer, markers, side_chat(row, s), cfg.max_tokens, s)
                                for s in ("chosen", "rejected"))  # fmt: skip
            if chosen == rejected:
                raise RowProblem("'chosen' and 'rejected' are the same")
            margin = row.get("margin", 0.0) if cfg.margin else 0.0
            if not isinstance(margin, int | float) or isinstance(margin, bool):
                raise RowProblem(f"'margin' must be a number, got {margin!r}")
            return Pair(row_id, chosen, rejected, float(margin))

        pairs, bad = read_rows(path, parse, cfg.on_bad_row, limit)
        return cls(pairs, str(path), bad)
