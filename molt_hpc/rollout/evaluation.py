"""Held-out evaluation: one greedy episode per eval prompt, scored by the same agent.

Greedy is `top_k = 1` (the engine keeps the arg-max token), so the result depends on the policy
only. Evaluation samples never reach the buffer; their mean reward and score go to `metrics.jsonl`
as `eval_reward` / `eval_score`, stamped with the policy version they evaluate.
"""

import asyncio
import statistics
from typing import Any

from molt_hpc.agents.calls import EngineError, EnvError, EpisodeLost
from molt_hpc.data import Prompt
from molt_hpc.log import get_logger
from molt_hpc.rollout.group import Runner

GREEDY = {"top_k": 1, "top_p": 1.0}
CONCURRENCY = 16
ATTEMPTS = 3


async def _one(runner: Runner, prompt: Prompt, rollout_id: str, gate: asyncio.Semaphore) -> tuple[float, float] | None:
    async with gate:
        for attempt in range(ATTEMPTS):
            try:
                session_id = f"{rollout_id}.a{attempt}"
                traj = await runner.run(
                    prompt, rollout_id=rollout_id, group_id="eval", session_id=session_id, overrides=GREEDY
                )
                return traj.reward, traj.score if traj.score is not None else traj.reward
            except EngineError:  # the router fails over; try again
                await asyncio.sleep(0.2 * 2**attempt)
            except EpisodeLost:  # its env worker went down with another episode's hang: try again
                continue
            except EnvError as err:  # counted as an eval error, the evaluation goes on
                get_logger().warning("eval prompt %s failed: %s", prompt.prompt_id, err)
                return None
    return None


async def evaluate(runner: Runner, prompts: list[Prompt], version: int) -> dict[str, Any]:
    """Greedy rollouts of `prompts`; a metrics record with `eval_reward` at `version`."""
    gate = asyncio.Semaphore(CONCURRENCY)
    results = await asyncio.gather(*(_one(runner, p, f"eval-v{version}-{i}", gate) for i, p in enumerate(prompts)))
    ok = [r for r in results if r is not None]
    return {
        "eval_version": version,
        "eval_reward": statistics.fmean(r for r, _ in ok) if ok else None,
        "eval_score": statistics.fmean(s for _, s in ok) if ok else None,
        "eval_prompts": len(prompts),
        "eval_errors": len(prompts) - len(ok),
    }
