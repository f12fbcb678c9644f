"""What colour is the shape? The tiny visual task a vision-language model learns on a CPU.

Rows (`data/color_train.jsonl`) show one image of a red, green or blue shape (`data/shapes/`) and ask
for its colour; the label is the colour's name. The reward (`colour_reward`) is 1 for the name, else
the share of its prefix right; the task score is exactness (1 for the name, else 0). The three names
start with different letters, so a policy that ignores the image averages at most 1/3 on both (checked
in `tests/test_vision_task.py`): more says the model reads the picture.
"""

from molt_hpc.agents import Env, Result, State
from molt_hpc.agents.shapes import colour_reward


class ColourEnv(Env):
    """Single turn: score the colour named, end the episode."""

    def step(self, state: State) -> Result:
        label = str(state.label)
        exact = float(state.action_text.strip() == label)
        return Result(reward=colour_reward(state.action_text, label), score=exact, terminated=True)
