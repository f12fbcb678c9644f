"""Agents: the user's environments (`Env`, multi-turn, exact log-probs) and chat agents (`ChatAgent`).

base.py          the API the user writes against: Env, Result, State, ChatAgent, ChatContext
step_runner.py   StepEnvRunner: env mode, token in, trace out
chat_runner.py   ChatAgentRunner: chat mode through the framework's OpenAI-compatible endpoint
loader.py        load_agent: the one agent class a file or module declares
calls.py         calling user code safely; EnvError / EngineError
observation.py   an observation as the tokens that follow an action (chat-template glue)
grading.py       the math grader; arith.py the safe arithmetic evaluator of the calculator env
shapes.py        the synthetic visual task's images and reward (envs/color*.py)
"""

from molt_hpc.agents.base import ChatAgent, ChatContext, Env, Result, State
from molt_hpc.agents.calls import EngineError, EnvError
from molt_hpc.agents.chat_runner import ChatAgentRunner, ChatClient
from molt_hpc.agents.loader import load_agent
from molt_hpc.agents.step_runner import StepEnvRunner

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
