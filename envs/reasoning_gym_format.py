"""Reasoning-gym tasks with a format bonus, for small models: the task's own score (`envs/reasoning_gym.py`),
and `FORMAT_BONUS` for a well-formed answer (`<answer>…</answer>`, `\\boxed{…}`) that scores 0.

`score` (what `[eval]` counts as a pass, and what the step line reports as the task score) stays the task's
own score: the bonus shapes training, it never passes an evaluation. The reason is `envs/math_format.py`'s:
a 135M-parameter model writes the asked-for tag in a few percent of its samples at first, and a
correctness-only reward gives GRPO groups of equal rewards.
"""

from molt_hpc.agents import Env, Result, State
from molt_hpc.datasets.generated import score_reply

FORMAT_BONUS = 0.2


class ReasoningGymFormatEnv(Env):
    """Score the reply with its task's scorer, add the bonus to a well-formed answer that scored 0."""

    def step(self, state: State) -> Result:
        score, answered = score_reply(state.row, state.action_text)
        reward = FORMAT_BONUS if answered and score == 0.0 else score
        info = {"missing_answer": float(not answered), "correct": float(score == 1.0)}
        return Result(reward=reward, score=score, terminated=True, info=info)
