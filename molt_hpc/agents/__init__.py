"""Agents: the user's environments (`Env`, multi-turn, exact log-probs) and chat agents (`ChatAgent`).

base.py          the API the user writes against: Env, Result, State, ChatAgent, ChatContext
step_runner.py   StepEnvRunner: env mode, token in, trace out
chat_runner.py   ChatAgentRunner: chat mode through the framework's OpenAI-compatible endpoint
chat_trace.py    a chat episode's trace rebuilt from the endpoint's calls (segments, log-probs, routing)
loader.py        load_agent: the one agent class a file or module declares
calls.py         calling user code safely; EnvError / EngineError
env_hosts.py     where env calls run (the runner's interface); the orchestrator's threads
env_workers.py   ... or worker processes (rollout.env_workers); env_worker.py is that process
observation.py   an observation as the tokens that follow an action (chat-template glue)
grading.py       the math grader; arith.py the safe arithmetic evaluator of the calculator env
shapes.py        the synthetic visual task's images and reward (envs/color*.py)
routing.py       a trajectory's MoE routing, assembled turn by turn from the engine's `routed_experts`
openai_client.py ready OpenAI clients for chat-mode agents: one HTTP client per rollout process
"""

from typing import TYPE_CHECKING, Any

from molt_hpc.agents.base import ChatAgent, ChatContext, Env, Result, State
from molt_hpc.agents.calls import EngineError, EnvError

if TYPE_CHECKING:
    from molt_hpc.agents.chat_runner import ChatAgentRunner, ChatClient
    from molt_hpc.agents.loader import load_agent
    from molt_hpc.agents.step_runner import StepEnvRunner

# An env file's `from molt_hpc.agents import Env, Result` imports only the API (base, calls): an env
# worker process starts in a fraction of a second. The runners (aiohttp, the config tree) load on use.
_LAZY = {
    "ChatAgentRunner": "chat_runner",
    "ChatClient": "chat_runner",
    "load_agent": "loader",
    "StepEnvRunner": "step_runner",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)


__all__ = [
    "ChatAgent",
    "ChatAgentRunner",
    "ChatClient",
    "ChatContext",
    "EngineError",
    "Env",
    "EnvError",
    "Result",
    "State",
    "StepEnvRunner",
    "load_agent",
]
