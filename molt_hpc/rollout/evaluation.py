"""Held-out evaluation (`[eval]`): `n` episodes per prompt at the evaluation's temperature, scored by the
same agent, reported as papers do: the unbiased pass@k of Chen et al. (2021) for each k of `eval.k`,
averaged over prompts, and the mean reward and score over every sample.

Temperature 0 is greedy (`top_k = 1`: the engine keeps the arg-max token), so the result depends on the
policy only; at a temperature each sample's seed comes from its id, so a version's evaluation is
reproducible. Evaluation samples never reach the buffer. The record (`eval_version`, `eval_pass@k`,
`eval_reward`, `eval_score`, ...) goes to `metrics.jsonl` under source `eval`; `eval_version_min` /
`eval_version_max` are the policy versions its tokens actually came from (a refit may land while it runs).
"""

import asyncio
import statistics
from typing import Any

from molt_hpc.agents.calls import EngineError, EnvError, EpisodeLost
from molt_hpc.config.evaluation import EvalConfig
from molt_hpc.data import Prompt
from molt_hpc.log import get_logger
from molt_hpc.rollout.group import Runner

CONCURRENCY = 16
ATTEMPTS = 3


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from `c` passing samples of `n`: 1 - C(n-c, k) / C(n, k), as the product
    1 - prod_{i=n-c+1}^{n} (1 - k/i), which never forms the (huge) binomials."""
    assert 0 <= c <= n and 1 <= k <= n, (n, c, k)
    if n - c < k:
        return 1.0
    fail = 1.0
    for i in range(n - c + 1, n + 1):
        fail *= 1.0 - k / i
    return 1.0 - fail


def sampling(ev: EvalConfig) -> dict[str, Any]:
    """The engine sampling overrides of an evaluation episode."""
    if ev.temperature == 0:
        return {"temperature": 0.0, "top_k": 1, "top_p": 1.0}
    return {"temperature": ev.temperature, "top_p": ev.top_p, "top_k": 0}


async def _one(
    runner: Runner, prompt: Prompt, rollout_id: str, gate: asyncio.Semaphore, overrides: dict[str, Any]
) -> tuple[float, float, list[int]] | None:
    """(reward, score, token versions) of one episode; None when its env failed."""
    async with gate:
        for attempt in range(ATTEMPTS):
            try:
                session_id = f"{rollout_id}.a{attempt}"
                traj = await runner.run(
                    prompt, rollout_id=rollout_id, group_id="eval", session_id=session_id, overrides=overrides
                )
                score = traj.score if traj.score is not None else traj.reward
                return traj.reward, score, list(traj.versions)
            except EngineError:  # the router fails over; try again
                await asyncio.sleep(0.2 * 2**attempt)
            except EpisodeLost:  # its env worker went down with another episode's hang: try again
                continue
            except EnvError as err:  # counted as an eval error, the evaluation goes on
                get_logger().warning("eval prompt %s failed: %s", prompt.prompt_id, err)
                return None
    return None


async def evaluate(runner: Runner, prompts: list[Prompt], version: int, ev: EvalConfig) -> dict[str, Any]:
    """`ev.n` episodes of each prompt; the metrics record of the policy at `version`. A failed episode counts
    as not passing (and in `eval_errors`), so pass@k keeps its n."""
    gate = asyncio.Semaphore(CONCURRENCY)
    overrides = sampling(ev)
    jobs = [
        _one(runner, p, f"eval-v{version}-{i}-s{j}", gate, overrides)
        for i, p in enumerate(prompts)
        for j in range(ev.n)
    ]
    results = await asyncio.gather(*jobs)
    per_prompt = [results[i * ev.n : (i + 1) * ev.n] for i in range(len(prompts))]
    ok = [r for r in results if r is not None]
    versions = [v for r in ok for v in r[2]]
    record: dict[str, Any] = {"eval_version": version}
    for k in ev.k:
        passes = [pass_at_k(ev.n, sum(r is not None and r[1] >= ev.pass_threshold for r in rs), k) for rs in per_prompt]
        record[f"eval_pass@{k}"] = statistics.fmean(passes) if passes else None
    record.update(
        {
            "eval_reward": statistics.fmean(r for r, _, _ in ok) if ok else None,
            "eval_score": statistics.fmean(s for _, s, _ in ok) if ok else None,
            "eval_prompts": len(prompts),
            "eval_samples": len(results),
            "eval_errors": len(results) - len(ok),
            "eval_version_min": min(versions, default=version),
            "eval_version_max": max(versions, default=version),
        }
    )
    return record
