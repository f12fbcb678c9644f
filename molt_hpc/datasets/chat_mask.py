"""Where the assistant replies lie in a conversation rendered by the model's own chat template, and
its token ids with the replies marked, for SFT and reward-model rows.

No `{% generation %}` tags are needed (the stock Llama-3, Qwen3 and Gemma templates have none, and
asking for an assistant mask then gives all zeros). The template is probed once per tokenizer
(`ReplyMarkers`), by rendering throw-away chats and taking the difference:

- `opener`: the text the generation prompt adds after a user turn (ChatML `<|im_start|>assistant\\n`).
  A reply is what the model produces after it, so it starts where an opener ends (a Qwen3 think
  scaffold after the opener is part of the reply: the model has to produce it too);
- `stop`: the first special token the template writes after a reply's content (`<|im_end|>`,
  `<|eot_id|>`). It is part of the reply, so the model learns to stop; the glue after it is not.

A conversation is rendered whole, cut at every opener (their number must equal the assistant
messages') and at each reply's stop token, and the pieces are tokenised one at a time: context,
reply, context, reply. These are exactly the tokens of a rollout trace (the prompt tokenised with
its generation prompt, then the reply as generated, ending in the stop token), so SFT, the reward
model and RL all see the same token boundaries. Rows end with their last trained reply.
"""

import re
from dataclasses import dataclass
from typing import Any

from molt_hpc.log import get_logger

PROBE_USER = "\x00molt-probe-user\x00"
PROBE_REPLY = "\x00molt-probe-reply\x00"


class RowProblem(ValueError):
    """A row that cannot become a training sample; the message is its reason (counted per reason)."""


@dataclass(frozen=True)
class ReplyMarkers:
    """The template's text around a reply (see the module docstring)."""

    opener: str
    stop: str | None
    """The stop token's text, or None when the template writes no special token after a reply."""
    specials: tuple[str, ...] = ()
    """Every special token's text: without a stop token a reply ends before the next one (untrained)."""

    @classmethod
    def probe(cls, tokenizer: Any) -> "ReplyMarkers":
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template; SFT and reward-model rows are chats and need one")
        user = [{"role": "user", "content": PROBE_USER}]
        bare, prompt = render(tokenizer, user, False), render(tokenizer, user, True)
        if not prompt.startswith(bare) or prompt == bare:
            raise ValueError("the chat template writes no generation prompt after a user turn; cannot find replies")
        opener = prompt[len(bare) :]
        full = render(tokenizer, [*user, {"role": "assistant", "content": PROBE_REPLY}], False)
        after = full[full.index(PROBE_REPLY) + len(PROBE_REPLY) :]
        specials = sorted(_special_texts(tokenizer), key=len, reverse=True)  # longest first at one position
        found = [(after.find(s), s) for s in specials if s and s in after]
        stop = min(found, key=lambda x: (x[0], -len(x[1])))[1] if found else None
        if stop is None:
            get_logger().warning(
                "the chat template writes no special token after a reply (%r): replies are trained without a "
                "stop token, so the model does not learn to stop; end each reply with the EOS token",
                after,
            )
        return cls(opener=opener, stop=stop, specials=tuple(specials))


def _special_texts(tokenizer: Any) -> set[str]:
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return set(tokenizer.all_special_tokens) | {t.content for t in added.values() if getattr(t, "special", False)}


def render(tokenizer: Any, messages: list[dict[str, Any]], generation_prompt: bool, tools=None) -> str:
    kwargs = {"tools": tools} if tools else {}
    return tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False, **kwargs)


@dataclass(frozen=True)
class Encoded:
    """A conversation as token ids, with the trained replies as half-open token spans."""

    token_ids: list[int]
    replies: list[tuple[int, int]]

    @property
    def supervised(self) -> int:
        return sum(e - s for s, e in self.replies)


def reply_spans(text: str, markers: ReplyMarkers, n_replies: int) -> list[tuple[int, int]]:
    """Character spans of the `n_replies` replies in a rendered conversation (opener end → stop end)."""
    starts = [m.end() for m in re.finditer(re.escape(markers.opener), text)]
    if len(starts) != n_replies:
        raise RowProblem(f"the chat template renders {len(starts)} reply openers for {n_replies} assistant messages")
    spans = []
    for i, start in enumerate(starts):
        limit = starts[i + 1] if i + 1 < len(starts) else len(text)
        if markers.stop is None:
            ends = [at for sp in markers.specials if (at := text.find(sp, start, limit)) >= 0]
            spans.append((start, min(ends, default=limit)))
            continue
        at = text.find(markers.stop, start, limit)
        if at < 0:
            raise RowProblem(f"a reply has no {markers.stop!r} after it in the rendered chat")
        spans.append((start, at + len(markers.stop)))
    return spans


def encode_chat(
    tokenizer: Any, markers: ReplyMarkers, messages: list[dict[str, Any]], trained: list[bool], tools=None
) -> Encoded:
    """Token ids of `messages` up to the last trained reply, and the spans of the trained replies.

    `trained[k]` says whether the k-th assistant message trains; the others stay context."""
    assert len(trained) == sum(m.get("role") == "assistant" for m in messages), "one flag per assistant message"
    if not any(trained):
        raise RowProblem("no assistant reply to train on")
    text = render(tokenizer, messages, False, tools)
    spans = [s for s, t in zip(reply_spans(text, markers, len(trained)), trained, strict=True) if t]
    ids: list[int] = []
    replies: list[tuple[int, int]] = []
    at = 0
    for start, end in spans:
        ids += _tokens(tokenizer, text[at:start])
        reply = _tokens(tokenizer, text[start:end])
        replies.append((len(ids), len(ids) + len(reply)))
        ids += reply
        at = end
    if not ids or replies[0][0] == 0:
        raise RowProblem("a reply starts the conversation: nothing comes before it to predict it from")
    return Encoded(ids, replies)


def _tokens(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []
