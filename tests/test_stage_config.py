"""The stages' config and commands: a config runs only under its own command, wrong input is one clear line
with exit code 2 before anything starts (the config, the pre-flight of the stage's own files and of a
reward model, the memory plan), run directories stand in for model paths, and the plan of a stage is its
own rows on the actor pool alone."""

import dataclasses
import json
import os

import pytest

from molt_hpc.config import ConfigError, load_config
from molt_hpc.launch.stage import stage_threads
from molt_hpc.models.resolve import run_model
from molt_hpc.plan import plan_config
from molt_hpc.plan.arch import arch_of
from molt_hpc.plan.shape import shape_of
from molt_hpc.plan.trainer import trainer_memory
from tests.conftest import ROOT, molt

RM_UNTRAINED = ["rm", "train", "configs/tiny_rm.toml", "--set", "model.path=builtin:tiny-char"]


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
        (
            ["sft", "configs/tiny_sft.toml", "--set", "actor.router_replay=true"],
            "run.stage = 'sft' has no engines whose routing could be replayed",
        ),
        (  # the pre-flight: the stage's own files, read as the stage reads them
            ["sft", "configs/tiny_sft.toml", "--set", "sft.data=no/such.jsonl"],
            "sft.data = 'no/such.jsonl': " + str(ROOT / "no/such.jsonl") + " does not exist",
        ),
        (
            [*RM_UNTRAINED, "--set", "rm.max_tokens=8"],
            "rm.data: " + str(ROOT / "data/reverse_prefs_train.jsonl") + ", line 1: too long (chosen: 35 tokens > "
            'rm.max_tokens = 8); fix the row or set rm.on_bad_row = "skip"',
        ),
        (
            ["run", "configs/tiny_rlhf.toml", "--set", "model.path=builtin:tiny-char", "--set", "reward_model.path=no"],
            "reward_model.path = 'no': reward_model.path " + str(ROOT / "no") + " does not exist",
        ),
        (  # the memory plan of the actor pool alone, as `run` makes it
            ["sft", "configs/tiny_sft.toml", "--set", "plan.host_memory_gib=0.001"],
            "the plan refuses this config; change it, or pass --no-plan to start anyway",
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


def test_a_stage_whose_model_is_an_unfinished_run_is_refused(tmp_path) -> None:
    (tmp_path / "checkpoints").mkdir()
    result = molt("rm", "train", "configs/tiny_rm.toml", "--set", f"model.path={tmp_path}")
    assert result.returncode == 2 and "is a run directory without a checkpoint yet" in result.stderr


def test_the_plan_of_a_stage_is_its_rows_on_the_actor_pool_alone() -> None:
    padded = ["actor.packing='off'", "actor.micro_batch_size=8", "algorithm.kl_coef=0.1"]
    sft = load_config(ROOT / "configs" / "tiny_sft.toml", padded)
    # sft.batch_size = 32 rows of sft.max_tokens = 64, 8 at a time; no reference
    s = shape_of(sft, 1, "cpu", arch_of(sft.model))
    assert (s.rows, s.seq, s.micro_batches, s.reference, s.critic, s.vocab_logits) == (8, 64, 4, False, False, True)
    rm = load_config(ROOT / "configs" / "tiny_rm.toml", padded)
    s = shape_of(rm, 2, "cpu", arch_of(rm.model))  # 64 pairs over 2 ranks, a pair one row of 2 × rm.max_tokens
    assert (s.rows, s.seq, s.micro_batches, s.vocab_logits) == (8, 128, 4, False)
    plan, _ = plan_config(rm, local=True, gpus=0)
    assert plan.placement.engines == 0 and [c.what for c in plan.checks] == ["host memory per actor node"]
    assert plan.refit_phase.name == "checkpoint (rank 0)"  # no refit: a checkpoint's whole tensor on rank 0

    def chunk(shape, vocab: int) -> float:  # the log-prob forward's chunk with the vocabulary at `vocab`
        phases = trainer_memory(dataclasses.replace(plan.arch, vocab=vocab), shape).phases
        return next(p for p in phases if p.name == "forward: log-probs").parts["log-prob chunk"]

    assert chunk(s, 10**5) == chunk(s, plan.arch.vocab)  # a reward model scores: no vocabulary log-probs
    sft_shape = shape_of(sft, 1, "cpu", plan.arch)
    assert chunk(sft_shape, 10**5) > chunk(sft_shape, plan.arch.vocab)
    assert plan.runnable


def test_a_stage_shares_the_cores_unless_omp_num_threads_says(monkeypatch) -> None:
    cores = len(os.sched_getaffinity(0))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert stage_threads(1) == str(cores)
    assert stage_threads(2) == str(max(1, cores // 2))
    assert stage_threads(4 * cores) == "1"
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert stage_threads(2) == "3"
    monkeypatch.setenv("OMP_NUM_THREADS", "4,2")  # a nested-parallelism list: not a count of ours
    assert stage_threads(1) == str(cores)
