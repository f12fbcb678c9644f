"""Tool calls in a model's reply: the parsers of `rollout.tool_parser`, and how `tool_choice` is honoured.

Pure functions over text. Two formats, the ones the common open models are trained on:

- `hermes` (Hermes, Qwen 2.5 / 3, the built-in tiny model): each call is
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; text before the first call is the
  reply's content. A last call whose closing tag the model never wrote (it stopped at its end-of-turn
  token) is read too.
- `llama3` (Llama 3.1 / 3.2 JSON tool calling): the reply is one or more JSON objects
  `{"name": ..., "parameters": {...}}` (or `"arguments"`), separated by `;`, optionally after
  `<|python_tag|>`, and nothing else.

A reply that reads as a call but is not a well-formed one (bad JSON, no name, arguments that are not an
object, a function the request did not offer, a second call where one was forced) yields no calls: the
endpoint returns it as plain text, as a model's malformed output is the model's to learn from, never a
server error.

`tool_choice` is honoured without constrained decoding: `none` leaves the reply unparsed; `required`
and a named function open the reply with the format's call prefix (`<tool_call>\\n{"name": "` or, for
a named function, up to its `"arguments": `), which goes to the engine as prompt, so the model writes
the rest; the prefix is part of the returned text and of the trace's context, never of an action.
"""

import json
import re
import uuid
from dataclasses import dataclass
from typing import Literal

ToolParser = Literal["hermes", "llama3", "none"]
HERMES_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: the function's name and its arguments as a JSON object's text."""

    name: str
    arguments: str

    def openai(self) -> dict:
        """The call as the OpenAI API's `message.tool_calls[i]`."""
        fn = {"name": self.name, "arguments": self.arguments}
        return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": fn}


def _call(obj: object, args_key: str) -> ToolCall | None:
    """A call from a decoded JSON object, or None when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get(args_key, obj.get("arguments", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string, as OpenAI sends them
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def parse_hermes(text: str) -> tuple[str | None, list[ToolCall]] | None:
    """(content before the first call or None, the calls) of a Hermes-format reply; None when it holds no
    `<tool_call>` or any call in it is malformed."""
    bodies = HERMES_CALL.findall(text)
    if not bodies:
        return None
    calls = []
    for body in bodies:
        try:
            call = _call(json.loads(body), "arguments")
        except ValueError:
            return None
        if call is None:
            return None
        calls.append(call)
    content = text[: text.index("<tool_call>")].strip()
    return content or None, calls


def parse_llama3(text: str) -> tuple[str | None, list[ToolCall]] | None:
    """(None, the calls) of a Llama 3 JSON reply: JSON objects separated by `;` and nothing else; None
    when the reply is anything else."""
    rest = text.strip().removeprefix(PYTHON_TAG).strip()
    if not rest.startswith("{"):
        return None
    decoder, calls = json.JSONDecoder(), []
    while rest:
        try:
            obj, end = decoder.raw_decode(rest)
        except ValueError:
            return None
        call = _call(obj, "parameters")
        if call is None:
            return None
        calls.append(call)
        rest = rest[end:].strip()
        if rest.startswith(";"):
            rest = rest[1:].strip()
        elif rest:
            return None
    return None, calls


PARSERS = {"hermes": parse_hermes, "llama3": parse_llama3}


def forced_prefix(parser: ToolParser, choice: str | None, name: str | None = None) -> str:
    """The text that opens the reply so a call is made: for `required`, up to the function's name; for a
    named function (`choice == "function"`), up to its arguments; "" otherwise."""
    if choice not in ("required", "function") or parser == "none":
        return ""
    if parser == "hermes":
        opening, args = '<tool_call>\n{"name": "', "arguments"
    else:
        opening, args = '{"name": "', "parameters"
    return opening if choice == "required" else f'{opening}{name}", "{args}": '


def parse_reply(
    parser: ToolParser, text: str, offered: set[str], choice: str | None, name: str | None = None
) -> tuple[str | None, list[ToolCall]] | None:
    """(content, calls) of a reply to a request offering the functions `offered` with `tool_choice`
    `choice` (`auto` when unset; a named one is `function`, with `name`); None: no well-formed call, the
    reply is plain text."""
    if parser == "none" or choice == "none" or not offered:
        return None
    parsed = PARSERS[parser](text)
    if parsed is None:
        return None
    content, calls = parsed
    if any(c.name not in offered for c in calls):
        return None
    if choice == "function" and (len(calls) != 1 or calls[0].name != name):
        return None
    return content, calls
