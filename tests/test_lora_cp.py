"""A LoRA policy under context parallelism, through `molt-hpc run`: 2 gloo ranks, one CP group of 2.

The adapters start with B = 0, so the policy of step 1 is the base: its KL to the reference (the same
model with the adapters off) is exactly 0, and grows once the adapters have moved.
"""

from pathlib import Path

from molt_hpc.log import read_metrics
from tests.test_e2e import launch


def test_lora_trains_under_context_parallelism(tmp_path: Path) -> None:
    proc = launch(
        tmp_path, "configs/tiny_cpu.toml", "--set", "run.steps=3", "--set", "actor.ranks=2", "--set", "actor.cp=2",
        "--set", "algorithm.kl_coef=0.01", "--set", "actor.lora.rank=8", "--set", "actor.lr=0.01",
    )  # fmt: skip
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    run_dir = tmp_path / "tiny-cpu"
    assert "context parallel 2" in (run_dir / "logs" / "actor.log").read_text()
    actor = read_metrics(run_dir / "metrics.jsonl", source="actor")
    assert [r["step"] for r in actor] == [1, 2, 3]
    assert actor[0]["kl"] == 0.0 and actor[-1]["kl"] > 0.0
    assert read_metrics(run_dir / "metrics.jsonl", source="launcher")[-1]["engine_versions"] == {"engine-0": 3}
