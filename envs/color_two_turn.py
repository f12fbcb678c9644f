"""What colour is the shape, twice: the env shows a second image after the first answer.

Turn 1 is a row of `data/color_train.jsonl` (one image, "What colour is the shape?"). Its answer earns
half its `colour_reward`; the env then shows a second shape (`Result.images`, drawn by
`molt_hpc.agents.shapes`, its colour and shape fixed by the row's id) and asks again; that answer
earns the other half. The trace holds both images; the model must read the second one to score.
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
    """Two turns, one image each; the reward is the mean of the two answers' scores."""

    def __init__(self) -> None:
        self.second: str | None = None

    def step(self, state: State) -> Result:
        if state.turn == 0:
            first = colour_reward(state.action_text, str(state.label))
            colour, shape, seed = second_shape(str(state.row.get("id", state.prompt)))
            self.second = colour
            return Result(
                reward=first / 2, terminated=False, observation=FOLLOW_UP, images=[draw(colour, shape, seed)],
                info={"first": first},
            )  # fmt: skip
        assert self.second is not None, "the second turn follows the first"
        second = colour_reward(state.action_text, self.second)
        return Result(reward=second / 2, terminated=True, info={"second": second})
