"""`ChatAgentRunner`: one dataset row → one `Trajectory`, the user's `ChatAgent` owning the loop.

The agent talks to the framework's OpenAI-compatible endpoint (`molt_hpc.rollout.chat_server`)
through a base URL bound to its session; the endpoint records every call. Afterwards the runner
rebuilds the trace from those records: consecutive calls whose prompt extends the previous
prompt + completion token for token form one trajectory (each completion an action, the text in
between context); where the template re-tokenised differently the chain restarts and the
earlier actions are left out (counted in `info["chat_prefix_breaks"]`).

Chat mode carries no rollout log-probs (the agent may as well call a remote API): the log-probs
are NaN and `info["rollout_logprobs"] = 0.0` marks the trajectory, so the trainer recomputes them
and treats the data as on-policy only. Weight versions are recorded from the engines.
"""

import json
import math
from typing import Any
from urllib.parse import quote

import aiohttp

from molt_hpc.agents.base import ChatAgent, ChatContext, Result
from molt_hpc.agents.calls import EngineError, EnvError, call_user
from molt_hpc.agents.openai_client import OpenAIPool
from molt_hpc.config.rollout import RolloutConfig
from molt_hpc.data import Prompt
from molt_hpc.trajectory import Trajectory


class ChatClient:
    """A minimal OpenAI-style client: `await chat(messages, **params)` → the reply's text."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str, api_key: str):
        self.session, self.base_url, self.api_key = session, base_url.rstrip("/"), api_key

    async def completion(self, messages: list[dict[str, Any]], **params: Any) -> dict[str, Any]:
        headers = {"Authorization": f"Bearer {self.api_key}"}
        body = {"messages": messages, **params}
        async with self.session.post(f"{self.base_url}/chat/completions", json=body, headers=headers) as resp:
            text = await resp.text()
        if resp.status >= 300:
            raise RuntimeError(f"chat endpoint answered HTTP {resp.status}: {text[:500]}")
        return json.loads(text)

    async def chat(self, messages: list[dict[str, Any]], **params: Any) -> str:
        return (await self.completion(messages, **params))["choices"][0]["message"]["content"]


def trajectory_from_calls(calls: list[Any], *, rollout_id: str, group_id: str) -> tuple[Trajectory, int]:
    """The longest exact chain of recorded calls ending at the last one, and how many breaks came before."""
    breaks = 0
    tokens: list[int] = []
    ranges: list[tuple[int, int]] = []
    versions: list[int] = []
    prompt_len = 0
    for i, call in enumerate(calls):
        if i == 0 or call.prompt_ids[: len(tokens)] != tokens:
            breaks += i > 0
            ranges, versions, prompt_len = [], [], len(call.prompt_ids)
        start = len(call.prompt_ids)
        tokens = list(call.prompt_ids) + list(call.completion_ids)
        if call.completion_ids:
            ranges.append((start, len(tokens)))
        versions += list(call.versions)
    n_action = sum(e - s for s, e in ranges)
    traj = Trajectory(
        tokens=tokens,
        prompt_len=prompt_len,
        action_ranges=ranges,
        action_logprobs=[math.nan] * n_action,
        versions=versions,
        finish_reason=calls[-1].finish_reason,
        group_id=group_id,
        rollout_id=rollout_id,
    )
    return traj, breaks


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
        traj, breaks = trajectory_from_calls(calls, rollout_id=rollout_id, group_id=group_id)
        traj.reward = result.reward
        traj.score = result.score if result.score is not None else result.reward
        traj.info = {
            **result.info,
            "turns": float(len(traj.action_ranges)),
            "chat_calls": float(len(calls)),
            "chat_prefix_breaks": float(breaks),
            "rollout_logprobs": 0.0,
        }
        return traj
