"""Step 3 with a reward model: its score combined with the env's reward, per sample (pure functions).

With `z` the normalised score (`(score - mean) / std` from the reward model's held-out statistics, or
the raw score), `reward_model.combine` gives:

- `replace`: `z`;
- `add`: `env + weight · z`;
- `gate`: the env's reward decides validity, the model's normalised score the quality:
  `env` where `env <= gate_threshold` (an invalid sample: the model is not asked), else
  `env + weight · sigmoid(z)`. The model's term lies in (0, weight), so every valid sample outranks
  every invalid one with the same or lower env reward, and within one env reward the model orders.

GRPO's group normalisation comes later (`advantage.py`), unchanged.
"""

import math
from collections.abc import Sequence


def needs_score(env: float, combine: str, threshold: float) -> bool:
    """Whether the reward model is asked about a sample (`gate` skips invalid ones)."""
    return combine != "gate" or env > threshold


def normalised(score: float, mean: float = 0.0, std: float = 1.0) -> float:
    return (score - mean) / std


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def combine_reward(env: float, z: float | None, combine: str, weight: float = 1.0, threshold: float = 0.0) -> float:
    """The trained reward of one sample from its env reward and normalised score (None: not scored)."""
    if combine == "gate" and env <= threshold:
        return env
    assert z is not None, f"combine = {combine!r} needs the sample's score"
    if combine == "replace":
        return z
    if combine == "add":
        return env + weight * z
    assert combine == "gate", f"unknown combine {combine!r}"
    return env + weight * sigmoid(z)


def combine_rewards(
    env: Sequence[float], z: Sequence[float | None], combine: str, weight: float = 1.0, threshold: float = 0.0
) -> list[float]:
    return [combine_reward(e, s, combine, weight, threshold) for e, s in zip(env, z, strict=True)]
