"""Single-turn math with a format bonus, for small models: a correct final answer scores 1, a
well-formed answer (`<answer>…</answer>`, `\\boxed{…}`) with a wrong value scores `FORMAT_BONUS`,
no answer scores 0. Grading is `envs/math.py`'s (`molt_hpc.agents.grading`).

A 135M-parameter model sampled at temperature 1 writes the asked-for `<answer>` tag in 2-9% of
samples (depending on the prompt) and almost never the right value, so a correctness-only reward
leaves GRPO with groups of equal rewards (no advantage, filtered by dynamic sampling). The bonus is
the common way out: it teaches the format first, and the arithmetic earns the rest once the format
holds.
"""

from molt_hpc.agents import Env, Result, State
from molt_hpc.agents.grading import grade

FORMAT_BONUS = 0.2


class MathFormatEnv(Env):
    """Grade the reply, add the format bonus to a well-formed wrong answer, end the episode."""

    def step(self, state: State) -> Result:
        score, info = grade(state.action_text, state.label)
        if score == 0.0 and not info["missing_answer"]:
            score = FORMAT_BONUS
        return Result(reward=score, terminated=True, info=info)
