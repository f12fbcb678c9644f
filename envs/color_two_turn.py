"""What colour is the shape, twice: the env shows a second image after the first answer.

Turn 1 is a row of `data/color_train.jsonl` (one image, "What colour is the shape?"). Its answer earns
half its `colour_reward`; the env then shows a second shape (`Result.images`, drawn by
`molt_hpc.agents.shapes`, its colour and shape fixed by the row's id) and asks again; that answer
earns the other half. The score is the share of the two answers that name their colour exactly. The
trace holds both images; the model must read the second one to score.
"""

import hashlib

from molt_hpc.agents import Env, Result, State
from molt_hpc.agents.shapes import COLOURS, SHAPES, colour_reward, draw

FOLLOW_UP = "And this one?"


def second_shape(row_id: str) -> tuple[str, str, int]:
    """(colour, shape, seed) of the second image of row `row_id`: a fixed draw, so reruns agree."""
    n = int.from_bytes(hashlib.sha256(f"second:{row_id}".encode()).digest()[:8], "little")
    colours = sorted(COLOURS)
    return colours[n % 3], SHAPES[(n // 3) % 3], n % 1000


class ColourTwoTurnEnv(Env):
    """Two turns, one image each; the reward is the mean of the two answers' rewards, the score their exactness."""

    def __init__(self) -> None:
        self.second: str | None = None
        self.first_exact = 0.0

    def step(self, state: State) -> Result:
        answer = state.action_text.strip()
        if state.turn == 0:
            label = str(state.label)
            self.first_exact = float(answer == label)
            colour, shape, seed = second_shape(str(state.row.get("id", state.prompt)))
            self.second = colour
            return Result(
                reward=colour_reward(answer, label) / 2, score=self.first_exact / 2, terminated=False,
                observation=FOLLOW_UP, images=[draw(colour, shape, seed)],
            )  # fmt: skip
        assert self.second is not None, "the second turn follows the first"
        exact = float(answer == self.second)
        score = (self.first_exact + exact) / 2
        return Result(reward=colour_reward(answer, self.second) / 2, score=score, terminated=True)
