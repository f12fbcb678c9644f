"""`ChatAgentRunner`: one dataset row → one `Trajectory`, the user's `ChatAgent` owning the loop.

The agent talks to the framework's OpenAI-compatible endpoint (`molt_hpc.rollout.chat_server`)
through a base URL bound to its session; the endpoint records every call with the engine's per-token
log-probs, weight versions and (router replay) routing. Afterwards the runner rebuilds the trace from
those records (`molt_hpc.agents.chat_trace`): calls whose prompt extends an earlier prompt +
completion token for token form one segment (each completion an action, the text in between
context); a call that extends none (the template re-tokenised the history differently) opens another
segment. The sample then trains like an env-mode one: the engine's log-probs, off-policy correction,
the staleness bound. `info` counts the calls (`chat_calls`), the segments after the first
(`chat_prefix_breaks`) and the segments left out to fit `rollout.max_total_tokens`
(`chat_dropped_segments`).
"""

import json
from typing import Any
from urllib.parse import quote

import aiohttp

from molt_hpc.agents.base import ChatAgent, ChatContext, Result
from molt_hpc.agents.calls import EngineError, EnvError, call_user
from molt_hpc.agents.chat_trace import trajectory_from_calls
from molt_hpc.agents.openai_client import OpenAIPool
from molt_hpc.config.rollout import RolloutConfig
from molt_hpc.data import Prompt
from molt_hpc.trajectory import Trajectory


class ChatClient:
    """A minimal OpenAI-style client: `await chat(messages, **params)` → the reply's text."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str, api_key: str):
        self.session, self.base_url, self.api_key = session, base_url.rstrip("/"), api_key

    async def completion(self, messages: list[dict[str, Any]], **params: Any) -> dict[str, Any]:
        if params.get("stream"):
            raise ValueError("ctx.client reads whole answers: for stream=True use ctx.openai (the openai client)")
        headers = {"Authorization": f"Bearer {self.api_key}"}
        body = {"messages": messages, **params}
        async with self.session.post(f"{self.base_url}/chat/completions", json=body, headers=headers) as resp:
            text = await resp.text()
        if resp.status >= 300:
            raise RuntimeError(f"chat endpoint answered HTTP {resp.status}: {text[:500]}")
        return json.loads(text)

    async def chat(self, messages: list[dict[str, Any]], **params: Any) -> str:
        return (await self.completion(messages, **params))["choices"][0]["message"]["content"]


class ChatAgentRunner:
    """Runs `ChatAgent` episodes against the framework's chat endpoint."""

    def __init__(self, agent_cls: type[ChatAgent], server: Any, cfg: RolloutConfig, http: aiohttp.ClientSession):
        self.agent_cls, self.server, self.cfg, self.http = agent_cls, server, cfg, http
        self.openai = OpenAIPool(server)

    async def close(self) -> None:
        await self.openai.close()

    async def run(
        self,
        prompt: Prompt,
        *,
        rollout_id: str,
        group_id: str = "",
        session_id: str | None = None,
        overrides: dict[str, Any] | None = None,
    ) -> Trajectory:
        session_id = session_id or rollout_id
        base_url = f"{self.server.url}/s/{quote(session_id, safe='')}/v1"
        ctx = ChatContext(
            prompt=prompt.prompt,
            label=prompt.label,
            row=dict(prompt.extra),
            base_url=base_url,
            api_key=self.server.token,
            session_id=session_id,
            model=self.server.model,
            client=ChatClient(self.http, base_url, self.server.token),
            openai=self.openai.client(base_url, self.server.token),
            http_client=self.openai.http_client,
        )
        if overrides:
            self.server.overrides[session_id] = dict(overrides)
        timeout = self.cfg.env_timeout_s + self.cfg.max_turns * self.cfg.request_timeout_s
        try:
            agent = await call_user(self.agent_cls, timeout=self.cfg.env_timeout_s, what=f"{self.agent_cls.__name__}()")
            result = await call_user(agent.run, ctx, timeout=timeout, what="ChatAgent.run")
        finally:
            calls, failure = self.server.take(session_id)
        if failure is not None:
            raise EngineError(failure)  # the agent saw a failed call: its episode is not what the policy did
        if not isinstance(result, Result | str | list | dict | type(None)):  # a number, tensor or numpy scalar
            result = Result(reward=result)
        if not isinstance(result, Result):
            raise EnvError("api", f"ChatAgent.run returned {type(result).__name__}; return a float or a Result")
        if not calls:
            raise EnvError("api", "ChatAgent.run made no call to the chat endpoint")
        traj, breaks, dropped = trajectory_from_calls(
            calls, max_tokens=self.cfg.max_total_tokens, rollout_id=rollout_id, group_id=group_id
        )
        traj.reward = result.reward
        traj.score = result.score if result.score is not None else result.reward
        traj.info = {
            **result.info,
            "turns": float(len(traj.action_ranges)),
            "chat_calls": float(len(calls)),
            "chat_prefix_breaks": float(breaks),
            "chat_dropped_segments": float(dropped),
        }
        return traj
