"""The chat endpoint's request body, typed: what an OpenAI chat-completions request may carry.

Known fields are checked for type and range (finite numbers only; `null` means the default, as in
the OpenAI API); fields this endpoint does not know are ignored, as OpenAI-compatible servers do,
so a newer client's extra options do not break an agent. What the endpoint cannot honour (stop strings,
non-zero penalties) is refused by the server with its reason.

Tools follow the OpenAI API: `tools` is a list of `{"type": "function", "function": {"name",
"description", "parameters"}}`; `tool_choice` is `auto`, `none`, `required` or
`{"type": "function", "function": {"name": ...}}`. Messages reach the chat template as plain dicts:
an assistant message's `tool_calls` keep their ids, and their `function.arguments` (a JSON string in
the API) become the object the common templates (Qwen, Llama) write out with `tojson`.
"""

import contextlib
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

OPEN = ConfigDict(strict=True, extra="ignore", frozen=True, allow_inf_nan=False)
LOOSE = ConfigDict(strict=True, extra="allow", frozen=True, allow_inf_nan=False)


class Message(BaseModel):
    """One chat message; other keys (`name`, `tool_call_id`, ...) reach the chat template."""

    model_config = LOOSE

    role: str = Field(min_length=1, max_length=64)
    content: str | list[dict[str, Any]] | None = None
    """Text, a list of `{"type": "text", "text": ...}` parts, or null (an assistant turn of tool calls)."""
    tool_calls: list[dict[str, Any]] | None = None

    @model_validator(mode="after")
    def _check(self) -> "Message":
        self.template_dict()  # refused here, at the edge, rather than by the template
        return self

    def template_dict(self) -> dict[str, Any]:
        """The message as a chat template takes it: content as text, tool-call arguments as objects."""
        out = self.model_dump(exclude_none=True)
        out["content"] = _text(self.content)
        if self.tool_calls:
            out["tool_calls"] = [_template_call(c) for c in self.tool_calls]
        return out


def _text(content: str | list[dict[str, Any]] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ValueError(f"content parts of type {part.get('type')!r}: this endpoint takes text parts only")
        parts.append(part["text"])
    return "".join(parts)


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    fn = call.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ValueError("an assistant message's tool_calls need {'function': {'name': ..., 'arguments': ...}}")
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        with contextlib.suppress(ValueError):  # not JSON: the template writes the text as it came
            args = json.loads(args)
    return {**call, "function": {**fn, "arguments": args}}


class FunctionSpec(BaseModel):
    """A function offered to the model."""

    model_config = LOOSE

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(BaseModel):
    """One entry of `tools`."""

    model_config = LOOSE

    type: Literal["function"]
    function: FunctionSpec


class NamedChoice(BaseModel):
    """`tool_choice` naming the function to call."""

    model_config = OPEN

    type: Literal["function"]
    function: dict[str, str]


class StreamOptions(BaseModel):
    """`stream_options` of a streamed request."""

    model_config = OPEN

    include_usage: bool | None = None


class ChatRequest(BaseModel):
    """Body of `POST /v1/chat/completions`."""

    model_config = OPEN

    messages: list[Message] = Field(min_length=1)
    model: str | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    n: int | None = Field(None, ge=1, le=128)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    tools: list[Tool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedChoice | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    user: str | None = None

    @model_validator(mode="after")
    def _check_tool_choice(self) -> "ChatRequest":
        if self.tool_choice is None or self.tool_choice == "none":
            return self
        if not self.tools:
            raise ValueError("tool_choice needs tools: send the functions the model may call in `tools`")
        name = self.choice_name
        if name is not None and name not in self.offered:
            raise ValueError(f"tool_choice names {name!r}, which is not in tools ({sorted(self.offered)})")
        if isinstance(self.tool_choice, NamedChoice) and name is None:
            raise ValueError("a named tool_choice is {'type': 'function', 'function': {'name': ...}}")
        return self

    @property
    def offered(self) -> set[str]:
        """Names of the functions in `tools`."""
        return {t.function.name for t in self.tools or []}

    @property
    def choice(self) -> str | None:
        """`tool_choice` as one word: `auto` (tools without a choice), `none`, `required`, `function` (a
        named one); None without tools."""
        if not self.tools:
            return None
        if self.tool_choice is None:
            return "auto"
        return "function" if isinstance(self.tool_choice, NamedChoice) else self.tool_choice

    @property
    def choice_name(self) -> str | None:
        """The function a named `tool_choice` forces."""
        return self.tool_choice.function.get("name") if isinstance(self.tool_choice, NamedChoice) else None

    def template_messages(self) -> list[dict[str, Any]]:
        """The messages as the chat template takes them (plain dicts, extra keys kept)."""
        return [m.template_dict() for m in self.messages]

    def template_tools(self) -> list[dict[str, Any]] | None:
        """`tools` as the chat template takes them (OpenAI's shape), or None without any."""
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None
