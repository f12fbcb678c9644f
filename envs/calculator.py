"""Multi-turn math with a calculator tool: the model may write `<calc>3*7</calc>`, gets
`<result>21</result>` back as the next turn, and answers with `<answer>…</answer>` (graded like
`envs/math.py`) within `MAX_CALLS` calculator calls.

The expression is evaluated by `molt_hpc.agents.arith.calculate` (a restricted AST walk over numbers
and arithmetic operators, never `eval`); a malformed one answers `<result>error: …</result>`.
`envs/calculator_chat.py` is the same task in chat mode, with the calculator as an OpenAI tool.
Set `rollout.max_turns` to at least `MAX_CALLS + 1` so the model has a turn left to answer.
"""

import re

from molt_hpc.agents import Env, Result, State
from molt_hpc.agents.arith import calculate
from molt_hpc.agents.grading import extract_answers, grade

CALL_RE = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
MAX_CALLS = 3


class CalculatorEnv(Env):
    """An answer ends the episode; a calculator call gets its result as the next observation."""

    def __init__(self) -> None:
        self.calls = 0

    def step(self, state: State) -> Result:
        text = state.action_text
        if extract_answers(text):
            score, info = grade(text, state.label)
            return Result(reward=score, terminated=True, info={**info, "calls": float(self.calls)})
        call = CALL_RE.search(text)
        if call is None:
            _, info = grade(text, state.label)
            return Result(reward=0.0, terminated=True, info={**info, "calls": float(self.calls)})
        if self.calls >= MAX_CALLS:
            info = {"answers": 0.0, "missing_answer": 1.0, "correct": 0.0, "calls": float(self.calls)}
            return Result(reward=0.0, terminated=False, truncated=True, info=info)
        self.calls += 1
        return Result(
            reward=0.0,
            observation=f"<result>{calculate(call.group(1))}</result>",
            terminated=False,
            info={"calls": float(self.calls)},
        )
