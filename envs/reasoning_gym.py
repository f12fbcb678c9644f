"""Reasoning-gym tasks (`[data.generator]` rows): the reply's final `<answer>…</answer>` (or `\\boxed{…}`; the
last one counts) is scored by the task's own `score_answer` against the generated item the row carries
(`entry`), so every task keeps its own rules (exact match, numeric tolerance, partial credit, any valid
solution of a puzzle).

Reward = that score in [0, 1]; `info` counts missing answers, as the math env does.
"""

from functools import cache

from molt_hpc.agents import Env, Result, State
from molt_hpc.agents.grading import extract_answers


@cache
def scorer(task: str):
    """The task's scoring function (a reasoning-gym dataset of its default config, built once per process)."""
    from reasoning_gym import get_score_answer_fn

    return get_score_answer_fn(task)


class ReasoningGymEnv(Env):
    """Score the reply with its task's scorer and end the episode."""

    def step(self, state: State) -> Result:
        answers = extract_answers(state.action_text)
        final = answers[-1].strip() if answers else ""
        entry = state.row.get("entry")
        if entry is None or "task" not in state.row:
            raise ValueError("reasoning-gym rows carry `task` and `entry`: generate them with [data.generator]")
        score = float(scorer(state.row["task"])(final, entry)) if final else 0.0
        info = {"missing_answer": float(not final), "correct": float(score == 1.0)}
        return Result(reward=score, terminated=True, info=info)
