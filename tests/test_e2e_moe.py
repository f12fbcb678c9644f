"""`builtin:tiny-moe` learns the reverse task through `molt-hpc run` with router replay on.

Real processes throughout (launcher, torchrun trainer, builtin engine, router, orchestrator, buffer);
the checks read the run's own metrics.jsonl.
"""

from pathlib import Path

import pytest

from molt_hpc.log import read_metrics
from tests.test_e2e import launch, steps_and_rising_reward

pytestmark = pytest.mark.slow


def test_tiny_moe_learns_with_router_replay(tmp_path: Path) -> None:
    steps = 80  # reward 0.07 -> 0.48 between the first and last quarter of 120 steps; 80 rise far past 0.1
    proc = launch(tmp_path, "configs/tiny_moe_cpu.toml", "--set", f"run.steps={steps}")
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    actor = steps_and_rising_reward(tmp_path / "tiny-moe-cpu", steps)
    # Step 1 trains on version-0 rollouts with the version-0 weights, both in fp32: the trainer's live
    # routing is the engine's (batched on the engine, padded on the trainer: a near-tie may round apart).
    first = actor[0]
    assert first["staleness"] == {"0": 8}
    assert first["routing_agreement"] > 0.999
    assert first["replayed_tokens"] > 0.9 * first["tokens"] and first["unreplayed_samples"] == 0
    for r in actor:
        assert 0.0 <= r["routing_agreement"] <= 1.0 and r["moe_load_imbalance"] >= 1.0
        assert r["moe_aux_loss"] > 0 and r["moe_z_loss"] > 0
    assert read_metrics(tmp_path / "tiny-moe-cpu" / "metrics.jsonl", source="launcher")[-1]["event"] == "finished"
