"""Reasoning-gym tasks (`[data.generator]` rows): the reply's final `<answer>…</answer>` (or `\\boxed{…}`; the
last one counts) is scored by the task's own `score_answer` against the generated item the row carries
(`entry`), so every task keeps its own rules (exact match, numeric tolerance, partial credit, any valid
solution of a puzzle).

Reward = that score in [0, 1]; `info` counts missing answers, as the math env does.
"""

from molt_hpc.agents import Env, Result, State
from molt_hpc.datasets.generated import score_reply


class ReasoningGymEnv(Env):
    """Score the reply with its task's scorer and end the episode."""

    def step(self, state: State) -> Result:
        score, answered = score_reply(state.row, state.action_text)
        info = {"missing_answer": float(not answered), "correct": float(score == 1.0)}
        return Result(reward=score, terminated=True, info=info)
