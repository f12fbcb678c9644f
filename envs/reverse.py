"""Reverse a short string: the tiny task the CPU demo learns on.

Prompt `Reverse: abc`, label `cba`. The reward (`reverse_reward`, shared with the chat-mode
version `envs/reverse_chat.py`) is the fraction of positions where the answer
matches the label, over the longer of the two (an exact reversal scores 1.0, extra characters
cost credit). The answer is the model's text decoded with special tokens skipped, stripped of
surrounding whitespace, so emitting special tokens never spells an answer. With letters drawn
uniformly from k letters, a policy that ignores the prompt averages at most 1/k of the maximum
(each label position is uniform and independent of anything it can see); the shipped data uses
k = 4 (`data/make_datasets.py`, checked in `tests/test_envs_reverse.py`).
"""

from molt_hpc.agents import Env, Result, State
from molt_hpc.agents.grading import reverse_reward


class ReverseEnv(Env):
    """Single turn: score the reversal, end the episode."""

    def step(self, state: State) -> Result:
        label = str(state.label)
        reward = reverse_reward(state.action_text, label)
        exact = float(state.action_text.strip() == label)
        return Result(reward=reward, terminated=True, info={"exact": exact})
