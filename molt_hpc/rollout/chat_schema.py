"""The chat endpoint's request body, typed: what an OpenAI chat-completions request may carry.

Known fields are checked for type and range (finite numbers only; `null` means the default, as in
the OpenAI API); fields this endpoint does not know are ignored, as OpenAI-compatible servers do,
so a newer client's extra options do not break an agent. What the endpoint cannot honour (n > 1,
streaming, stop strings, non-zero penalties) is refused by the server with its reason.
"""

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

OPEN = ConfigDict(strict=True, extra="ignore", frozen=True, allow_inf_nan=False)


class Message(BaseModel):
    """One chat message; other keys (`name`, `tool_calls`, `tool_call_id`) reach the chat template."""

    model_config = ConfigDict(strict=True, extra="allow", frozen=True, allow_inf_nan=False)

    role: str = Field(min_length=1, max_length=64)
    content: str


class ChatRequest(BaseModel):
    """Body of `POST /v1/chat/completions`."""

    model_config = OPEN

    messages: list[Message] = Field(min_length=1)
    model: str | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    n: int | None = Field(None, ge=1)
    stream: bool | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    user: str | None = None

    def template_messages(self) -> list[dict[str, Any]]:
        """The messages as the chat template takes them (plain dicts, extra keys kept)."""
        return [m.model_dump() for m in self.messages]
