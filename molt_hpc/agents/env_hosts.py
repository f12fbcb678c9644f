"""Where env code runs, as the runner sees it: an env host and its episodes.

`StepEnvRunner` calls an env host instead of the env: `await host.open(state)` builds an episode's
env, `await episode.reset(state)` and `await episode.step(state)` call it, `episode.close()` ends it;
`host.stats()` adds the host's counters to the rollout records. Tokenising and generating stay in the
orchestrator. Two hosts:

- `InProcessEnvs` (here; `rollout.env_workers = 0`): user code in daemon threads of the orchestrator
  (`call_user`). A call past `rollout.env_timeout_s` fails its sample, but code that holds the GIL (a
  runaway regular expression, a long C call) freezes the whole orchestrator, its clocks included.
- `EnvWorkerPool` (`env_workers.py`): user code in worker processes, so that it cannot.
"""

import os
from typing import Any, Literal, Protocol

from molt_hpc.agents.base import Env, State
from molt_hpc.agents.calls import call_user


class Episode(Protocol):
    async def reset(self, state: State) -> Any: ...
    async def step(self, state: State) -> Any: ...
    def close(self) -> None: ...


class EnvHost(Protocol):
    async def open(self, state: State) -> Episode: ...
    def stats(self) -> dict[str, Any]: ...


def worker_count(setting: int | Literal["auto"]) -> int:
    """`rollout.env_workers` as a number: `auto` is one per 8 usable cores, at least 2 and at most 8."""
    if setting != "auto":
        return setting
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(2, min(8, cores // 8))


class InProcessEnvs:
    """Env calls in the orchestrator's threads (`rollout.env_workers = 0`)."""

    def __init__(self, env_cls: type[Env], timeout_s: float):
        self.env_cls, self.timeout_s = env_cls, timeout_s

    async def open(self, state: State) -> "InProcessEpisode":
        env = await call_user(self.env_cls, timeout=self.timeout_s, what=f"{self.env_cls.__name__}()")
        return InProcessEpisode(env, self.timeout_s)

    def stats(self) -> dict[str, Any]:
        return {}


class InProcessEpisode:
    def __init__(self, env: Env, timeout_s: float):
        self.env, self.timeout_s = env, timeout_s

    async def reset(self, state: State) -> Any:
        return await call_user(self.env.reset, state, timeout=self.timeout_s, what="Env.reset")

    async def step(self, state: State) -> Any:
        return await call_user(self.env.step, state, timeout=self.timeout_s, what="Env.step")

    def close(self) -> None:
        pass
