"""The math env with a format bonus: correct 1, well-formed but wrong FORMAT_BONUS, no answer 0."""

import pytest

from molt_hpc.agents import State
from molt_hpc.agents.loader import load_agent


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("<answer>42</answer>", 1.0),
        (r"so \boxed{42}", 1.0),
        ("<answer>41</answer>", 0.2),
        (r"\boxed{forty}", 0.2),
        ("the answer is 42", 0.0),
        ("<answer></answer>", 0.0),
        ("", 0.0),
    ],
)
def test_math_format_reward(text: str, expected: float) -> None:
    env_cls = load_agent("envs/math_format.py")
    module = __import__(env_cls.__module__)
    assert module.FORMAT_BONUS == 0.2
    result = env_cls().step(State(prompt="p", label="42", action_text=text))
    assert result.reward == expected and result.terminated
