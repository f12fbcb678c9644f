"""Single-turn math: the reply's final answer (`<answer>…</answer>`, `\\boxed{…}`, `\\fbox{…}`) is
graded against the label with `math-verify` (`molt_hpc.agents.grading` has the rules: the last answer
counts, `3 == 3.0`, `1/2 == 0.5 == \\frac{1}{2}`, `1e5 == 100000`, equivalent expressions, sets and
intervals match; an answer whose value would explode scores 0 unevaluated).

Reward 1 for a correct answer, 0 otherwise; `info` counts missing answers so a run can see the
model learning the format separately from the arithmetic.
"""

from molt_hpc.agents import Env, Result, State
from molt_hpc.agents.grading import grade


class MathEnv(Env):
    """Grade the reply and end the episode."""

    def step(self, state: State) -> Result:
        score, info = grade(state.action_text, state.label)
        return Result(reward=score, terminated=True, info=info)
