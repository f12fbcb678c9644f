"""One group: `rollout.n_samples` concurrent episodes of one prompt, with the per-sample fault policy.

Each sample has its own rollout id (`<group id>.s<j>`) and, per attempt, its own router session
(`<rollout id>.a<attempt>`), so a retried sample starts afresh on whichever engine is healthy (ids
hold no `/`: chat mode puts the session in URL paths).
A failed engine call is continued on another engine from its tokens (`molt_hpc.rollout.resume`);
only a turn that could not be continued (`EngineError`) retries the sample from its start, up to
`ENGINE_RESTARTS` times, and the tokens that throws away are counted (`tokens_discarded`); an
environment failure (`EnvError`) drops the whole group (`on_env_error = "drop_group"`) or retries
the sample up to `rollout.max_retries` times. An episode lost with its env worker that could not be
rebuilt elsewhere (`EpisodeLost`: a non-deterministic env) starts again at once, up to `ENGINE_RETRIES`
times. A failed group cancels its other samples at once.
"""

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Protocol

from molt_hpc.agents.calls import EngineError, EnvError, EpisodeLost
from molt_hpc.config.rollout import RolloutConfig
from molt_hpc.data import Position, Prompt
from molt_hpc.log import get_logger
from molt_hpc.trajectory import Group, Trajectory

ENGINE_RETRIES = 20
"""Lost env workers one sample survives before its group is dropped."""
ENGINE_RESTARTS = 2
"""Turns that failed past their continuations (`rollout.engines.RESUMES`) one sample survives."""


class Runner(Protocol):
    async def run(
        self, prompt: Prompt, *, rollout_id: str, group_id: str, session_id: str, overrides: dict[str, Any] | None
    ) -> Trajectory: ...


class SampleFailed(Exception):
    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass
class GroupOutcome:
    """A finished group (or why it failed) and what it cost."""

    position: Position
    prompt: Prompt
    group: Group | None = None
    failure: str | None = None
    env_errors: Counter = field(default_factory=Counter)
    engine_retries: int = 0
    env_retries: int = 0
    env_restarts: int = 0
    """Samples started again because their env worker was lost (`EpisodeLost`)."""
    tokens_discarded: int = 0
    """Generated tokens thrown away by samples that started again after an engine failure."""
    seconds: float = 0.0
    first_error: str = ""
    """Why the group failed, as the failing sample's error says it (for the circuit breaker)."""


async def run_sample(
    runner: Runner, prompt: Prompt, rollout_id: str, group_id: str, cfg: RolloutConfig, out: GroupOutcome
) -> Trajectory:
    """One sample with retries; raises `SampleFailed` when its group must be dropped."""
    env_failures = engine_failures = restarts = 0
    while True:
        session_id = f"{rollout_id}.a{env_failures + engine_failures + restarts}"
        try:
            return await runner.run(
                prompt, rollout_id=rollout_id, group_id=group_id, session_id=session_id, overrides=None
            )
        except EnvError as err:  # the user's env failed this attempt: count it, then drop or retry per config
            out.env_errors[err.reason] += 1
            get_logger().warning("sample %s (prompt %s): env failed: %s", rollout_id, prompt.prompt_id, err)
            if cfg.on_env_error == "drop_group" or env_failures >= cfg.max_retries:
                out.first_error = out.first_error or f"env {err}"
                raise SampleFailed(f"env_{err.reason}") from err
            env_failures += 1
            out.env_retries += 1
        except EpisodeLost as err:  # another episode's timeout took this one's worker: nothing was wrong with it
            if restarts >= ENGINE_RETRIES:
                raise SampleFailed("env_lost") from err
            get_logger().info("sample %s: %s", rollout_id, err)
            restarts += 1
            out.env_restarts += 1
        except EngineError as err:  # its turn could not be continued anywhere: the sample starts again
            out.tokens_discarded += err.discarded
            if engine_failures >= ENGINE_RESTARTS:
                out.first_error = out.first_error or f"engine {err}"
                raise SampleFailed("engine") from err
            get_logger().info("sample %s: engine failed (%s); retrying from its start", rollout_id, err)
            engine_failures += 1
            out.engine_retries += 1
            await asyncio.sleep(min(5.0, 0.1 * 2**engine_failures))


async def run_group(
    runner: Runner, prompt: Prompt, position: Position, cfg: RolloutConfig, meta: dict[str, Any] | None = None
) -> GroupOutcome:
    """All samples of one prompt, concurrently; the outcome holds the `Group` or the failure reason."""
    out = GroupOutcome(position=position, prompt=prompt)
    group_id = position.group_id
    start = time.monotonic()
    try:
        async with asyncio.TaskGroup() as tg:
            tasks = [
                tg.create_task(run_sample(runner, prompt, f"{group_id}.s{j}", group_id, cfg, out))
                for j in range(cfg.n_samples)
            ]
    except ExceptionGroup as failed:
        others = [e for e in failed.exceptions if not isinstance(e, SampleFailed)]
        if others:  # not a sample failure but a bug or a refused request: stop with its own message
            raise others[0] from failed
        out.failure = failed.exceptions[0].reason
        out.seconds = time.monotonic() - start
        return out
    out.group = Group(
        group_id=group_id,
        prompt_id=prompt.prompt_id,
        samples=[t.result() for t in tasks],
        data_position={"epoch": position.epoch, "index": position.index},
        meta={"label": prompt.label, **(meta or {})},
    )
    out.seconds = time.monotonic() - start
    return out
