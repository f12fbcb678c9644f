"""Agents: the user's environments (`Env`, multi-turn, exact log-probs) and chat agents (`ChatAgent`).

`load_agent(spec)` finds the one agent class a file or module declares; the runners turn one
dataset row into one `Trajectory` through the engines.
"""

from molt_hpc.agents.base import ChatAgent, ChatContext, Env, Result, State

__all__ = ["ChatAgent", "ChatContext", "Env", "Result", "State"]
