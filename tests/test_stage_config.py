"""The stages' config and commands: a config runs only under its own command, wrong input is one clear line
with exit code 2, and run directories stand in for model paths."""

import json

import pytest

from molt_hpc.config import ConfigError, load_config
from molt_hpc.models.resolve import run_model
from tests.conftest import molt


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ["sft", "configs/tiny_rm.toml"],
            "this config is for `molt-hpc rm train` (run.stage = 'rm'), not `molt-hpc sft`",
        ),
        (["rm", "train", "configs/tiny_cpu.toml"], "`molt-hpc rm train` needs a [rm] section with at least `data`"),
        (["sft", "configs/tiny_sft.toml", "--set", "run.stage=rm"], "this config is for `molt-hpc rm train`"),
        (["submit", "configs/tiny_sft.toml", "--dry-run"], "Slurm jobs run the RL loop"),
        (
            ["sft", "configs/tiny_sft.toml", "--set", "sft.batch_size=0"],
            "sft.batch_size: Input should be greater than 0",
        ),
    ],
)
def test_stage_commands_refuse_with_one_line(args: list[str], expected: str) -> None:
    result = molt(*args)
    assert result.returncode == 2, result.stdout + result.stderr
    assert expected in result.stderr and "Traceback" not in result.stderr


def test_stage_configs_resolve() -> None:
    sft = load_config("configs/tiny_sft.toml")
    assert sft.run.stage == "sft" and sft.sft is not None and sft.rm is None and sft.reward_model is None
    assert load_config("configs/tiny_rm.toml").rm.center_coef == 0.01
    rl = load_config("configs/tiny_rlhf.toml")
    assert rl.run.stage == "rl" and rl.reward_model.combine == "gate"
    assert molt("config", "configs/tiny_sft.toml").stdout.count("[sft]") == 1


def test_cross_section_rules_of_the_stages() -> None:
    with pytest.raises(ConfigError, match=r"reward_model.kind = 'vllm' runs on GPUs"):
        load_config(None, ["reward_model.path=x", "reward_model.kind=vllm", "reward_model.device=cpu"])
    with pytest.raises(ConfigError, match=r"below 2 × rm.max_tokens \(a pair's two sides share a row\) \(512\)"):
        load_config(None, ["run.stage=rm", "rm.data=x", "actor.max_tokens_per_micro_batch=300"])
    # the budget is checked against the stage's rows, not the RL trajectories' (rollout.max_total_tokens = 128)
    fits = ["run.stage=sft", "sft.data=x", "sft.max_tokens=96", "actor.max_tokens_per_micro_batch=100"]
    assert load_config(None, fits).actor.max_tokens_per_micro_batch == 100


def test_a_run_directory_is_a_model_path(tmp_path) -> None:
    run = tmp_path / "sft-run"
    (run / "checkpoints").mkdir(parents=True)
    with pytest.raises(ValueError, match="run directory without a checkpoint yet"):
        run_model(run, "policy")
    step = run / "checkpoints" / "step_000003"
    (step / "policy").mkdir(parents=True)
    (step / "policy" / "config.json").write_text(json.dumps({}))
    (step / "manifest.json").write_text("{}")
    (run / "checkpoints" / "latest").write_text("step_000003")
    assert run_model(run, "policy") == step / "policy"
    with pytest.raises(ValueError, match=r"holds no reward model \(it has: policy\)"):
        run_model(run, "reward")
    assert run_model(step / "policy", "policy") == step / "policy"  # a model directory is itself
