"""The user-facing agent API: `Env` (the framework owns the loop), `ChatAgent` (the user owns it).

Env mode: one `Env` instance per episode (it may keep per-episode state on `self`).
`reset(state)` may return the first observation (text, chat messages, or `{"observation": ...}`)
to use instead of the dataset's prompt; `step(state)` scores `state.action_text` and returns a
`Result`. Both may be plain methods or coroutines. `State` reads as attributes or as a mapping
(`state["action_text"]`, `state.get("label")`, `state["observation_text"]`,
`state["sampling_params"]`), and `Result.reward` takes a number, a 0-d tensor or a numpy scalar,
so envs written for Molt run unchanged. The runner in `molt_hpc.agents.step_runner` drives it,
token in, trace out.

Chat mode: a `ChatAgent` gets a `ChatContext` (an OpenAI-compatible endpoint with its session
already bound) and returns its reward (a float or a `Result`). See `molt_hpc.agents.chat_runner`.
"""

import math
from dataclasses import dataclass, field, fields
from typing import Any

from molt_hpc.agents.calls import EnvError


def as_reward(value: Any, what: str = "Result.reward") -> float:
    """A step's reward as a float: a number, a 0-d tensor or a numpy scalar; anything else, or NaN or an
    infinity, is an `EnvError` that fails only this sample."""
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0 and getattr(value, "shape", ()) == ():
        value = value.item()  # torch.tensor(1.0), np.float32(1.0), np.array(1.0)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise EnvError(
            "api", f"{what} must be a number, a 0-d tensor or a numpy scalar, got {type(value).__name__}: {value!r}"
        )
    if not math.isfinite(value):
        raise EnvError("api", f"{what} is {value}: return a finite number")
    return float(value)


@dataclass
class Result:
    """What one `Env.step` returns."""

    reward: float = 0.0
    """Reward of this step; the trajectory's reward is the sum over its steps."""
    observation: str | dict[str, Any] | None = None
    """Next turn's input: text (sent as a user turn) or a chat message `{"role": "tool", "content": ...}`;
    ignored when the episode ends."""
    terminated: bool = True
    """The episode reached its end (an answer was given)."""
    truncated: bool = False
    """The episode was cut short by the environment (e.g. its own turn budget)."""
    info: dict[str, Any] = field(default_factory=dict)
    """Metrics of this step (JSON-able scalars); merged over the steps of an episode."""
    score: float | None = None
    """Task score to report (defaults to the reward)."""
    sampling_params: dict[str, Any] | None = None
    """Sampling-param overrides for the next turn only (e.g. `{"max_tokens": 8, "temperature": 0.7}`)."""
    images: list[Any] | None = None
    """Vision-language models: images shown with the next observation (PIL images, encoded bytes, paths,
    data URIs). Each takes an image part of the observation message (`{"type": "image"}` or an `<image>`
    mark in its text); a text observation without any gets them in front of its text."""

    def __post_init__(self) -> None:
        self.reward = as_reward(self.reward)
        if self.score is not None:
            self.score = as_reward(self.score, "Result.score")


@dataclass
class State:
    """What an environment sees: the dataset row, the turn so far and the conversation."""

    prompt: str | list[dict[str, Any]]
    """The row's prompt (text or chat messages), as in the dataset."""
    label: Any
    """The row's label."""
    row: dict[str, Any] = field(default_factory=dict)
    """Every other field of the row (`tools`, ids, images, ...)."""
    action_text: str = ""
    """The model's latest action, decoded with special tokens skipped."""
    action_ids: list[int] = field(default_factory=list)
    """The latest action's token ids (as the engine returned them)."""
    finish_reason: str = ""
    """Why the latest action ended: `stop` (EOS / stop token) or `length` (a token cap)."""
    turn: int = 0
    """Index of the latest action (0 for the first)."""
    history: list[dict[str, Any]] = field(default_factory=list)
    """Turns so far as chat messages: `{"role": "assistant", "content": action}` and the observations."""
    sampling_params: dict[str, Any] = field(default_factory=dict)
    """Sampling params the latest action was generated with."""
    observation_text: str = ""
    """What the latest action answered, decoded: the first prompt and every turn before the action."""

    @property
    def sandbox(self) -> Any:
        """The run's `SandboxClient` (`[sandbox]`): `await state.sandbox.run(code, stdin, files, timeout)`
        runs untrusted Python with no network and no view of the run (`run_sync` from a sync `step`)."""
        from molt_hpc.sandbox.client import default_client

        return default_client()

    # Mapping access, as Molt's envs read their state: `state["action_text"]`, `state.get("label")`.
    def __getitem__(self, key: str) -> Any:
        if key not in _STATE_KEYS:
            raise KeyError(f"State has no {key!r}; its keys are {', '.join(sorted(_STATE_KEYS))}")
        return getattr(self, key)

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key) if key in _STATE_KEYS else default

    def __contains__(self, key: object) -> bool:
        return key in _STATE_KEYS

    def keys(self) -> list[str]:
        return [f.name for f in fields(self)]


_STATE_KEYS = frozenset(f.name for f in fields(State))


class Env:
    """Base class of an environment; subclass it and override `step` (and `reset` if needed)."""

    def reset(self, state: State) -> str | list[dict[str, Any]] | dict[str, Any] | None:
        """The first observation (text, chat messages, or `{"observation": ...}`); None keeps the
        dataset's prompt (already tokenised). May be a coroutine, like `step`."""
        return None

    def step(self, state: State) -> Result:
        """Score `state.action_text`; return the reward and, for multi-turn, the next observation."""
        raise NotImplementedError


@dataclass
class ChatContext:
    """What a `ChatAgent` gets: the row, and an OpenAI-compatible endpoint bound to its session."""

    prompt: str | list[dict[str, Any]]
    """The row's prompt (text or chat messages)."""
    label: Any
    """The row's label."""
    row: dict[str, Any]
    """Every other field of the row."""
    base_url: str
    """OpenAI-compatible base URL (ends in `/v1`); the session id is part of the path, so any
    OpenAI client keeps every call of this episode on one engine."""
    api_key: str
    """Key to send as `Authorization: Bearer <api_key>` (the run's token)."""
    session_id: str
    """This episode's session id."""
    model: str
    """Model name to pass in requests (informational)."""
    client: Any = None
    """A ready `ChatClient` (`await ctx.client.chat(messages, **params) -> str`)."""
    openai: Any = None
    """A ready `openai.AsyncOpenAI` bound to this episode's session (`await
    ctx.openai.chat.completions.create(model=ctx.model, messages=...)`). It shares one connection
    pool with every other episode of the rollout process, so it costs nothing to use; needs the
    `openai` package (`pip install 'molt-hpc[chat]'`)."""
    http_client: Any = None
    """That shared `httpx` client, for agents that build their own OpenAI client:
    `AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, http_client=ctx.http_client)` is as
    cheap as `ctx.openai`; without `http_client=` every client builds a TLS context (~60–100 ms)."""


class ChatAgent:
    """Base class of a chat-mode agent; subclass it and override the coroutine `run`."""

    async def run(self, ctx: ChatContext) -> float | Result:
        """Play one episode through `ctx` and return its reward (or a `Result` with reward, info, score)."""
        raise NotImplementedError
