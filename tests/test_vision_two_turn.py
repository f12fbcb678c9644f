"""The two-turn variant of the synthetic visual task learns on a CPU through `molt-hpc run` (real processes:
launcher, FSDP2 trainer, builtin engine, router, rollout), read from the run's own records as
`tests/test_vision_task.py` reads the single-turn run. A file of its own so that the two runs, each minutes
long, can go to different test workers.
"""

import pytest

from tests.test_vision_task import rises


@pytest.mark.slow
def test_two_turn_colour_task_learns(tmp_path) -> None:
    """The env shows a second image after the first answer; each answer earns half the reward, so the sum
    rises about half as fast as the single-turn reward at first. Twice the config's learning rate keeps the
    run short: 64 steps (~2 minutes here), before the policy turns nearly deterministic and dynamic sampling
    drops most groups. Measured here: 0.009 -> 0.08 and, over the first 64 steps of a 100-step run, 0.009 ->
    0.102. An unchanged policy's quarter means (1,024 samples each, per-sample std ~0.04 at these rewards)
    differ by ~0.002: a rise of 0.04 is far outside that."""
    first, last, _ = rises(tmp_path, 64, "actor.lr=2e-3", "rollout.agent=envs/color_two_turn.py", "rollout.max_turns=2")
    assert last > first + 0.04, f"reward did not rise: first quarter {first:.3f}, last quarter {last:.3f}"
