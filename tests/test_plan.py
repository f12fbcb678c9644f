"""`molt-hpc plan`: parameter counts against closed forms, the per-GPU terms against their formulas,
the verdict of every shipped config, re-planned suggestions, and the plan that `run` and `submit`
make before anything starts (refusal in one line, exit 2; `--no-plan` skips it).
"""

import json
import os
import shutil
from pathlib import Path

import pytest

from molt_hpc.config import load_config
from molt_hpc.config.model import ModelConfig
from molt_hpc.plan import plan_config
from molt_hpc.plan.arch import arch_of
from molt_hpc.plan.engine import GIB
from molt_hpc.plan.shape import shape_of
from molt_hpc.plan.suggest import with_changes
from molt_hpc.plan.trainer import trainer_memory
from tests.conftest import ROOT, molt

CONFIGS = sorted((ROOT / "configs").glob("*.toml"))
MODELS = ROOT / "configs" / "models"


def arch(name: str):
    return arch_of(ModelConfig(path="/not/here", architecture=str(MODELS / name)))


def test_dense_parameter_count_is_the_closed_form() -> None:
    a = arch("llama-3.1-8b")
    h, i, v, L, kv = 4096, 14336, 128256, 32, 8 * 128
    block = h * (h + 2 * kv) + h * h + 3 * h * i + 2 * h  # q, k, v, o, the MLP, two norms
    assert a.params == 2 * v * h + h + L * block == 8_030_261_248  # the published count
    assert a.root_params == 2 * v * h + h
    assert a.kv_bytes_per_token(1, 2) == L * 2 * 8 * 128 * 2
    assert a.kv_bytes_per_token(4, 2) == L * 2 * 2 * 128 * 2  # 8 KV heads over 4 TP ranks


def test_moe_parameter_count_splits_experts_and_router() -> None:
    a = arch("qwen2-57b-a14b")
    h, e, im, L = 3584, 64, 2560, 28
    assert a.expert_params == L * e * 3 * h * im
    assert a.router_params == L * e * h  # mlp.gate, not shared_expert_gate
    assert round(a.params / 1e9, 1) == 57.4
    mla = arch("kimi-k2")
    assert mla.mla and mla.kv_bytes_per_token(8, 2) == 61 * (512 + 64) * 2  # one latent per layer, every rank
    assert round(mla.params / 1e12, 2) == 1.03


def test_persistent_state_is_16_bytes_per_parameter_over_the_ranks() -> None:
    cfg = load_config(ROOT / "configs" / "8b_dense.toml")
    a = arch("llama-3.1-8b")
    mem = trainer_memory(a, shape_of(cfg, 8, "cuda", a))
    assert mem.state == {"parameters": 4 * a.params / 8, "gradients": 4 * a.params / 8, "optimizer": 8 * a.params / 8}
    off = trainer_memory(a, shape_of(with_changes(cfg, ["actor.offload='optimizer'"]), 8, "cuda", a))
    assert off.state["optimizer"] == 0 and off.host["optimizer"] == 8 * a.params / 8
    # offloaded between steps, but back on the GPU whole for the step (actor/offload.py): the step's phase has them
    kept, offloaded = (next(p for p in m.phases if p.name == "optimizer step") for m in (mem, off))
    assert offloaded.total == pytest.approx(kept.total) and offloaded.parts["optimizer (on the GPU for the step)"] > 0
    ref = trainer_memory(a, shape_of(with_changes(cfg, ["algorithm.kl_coef=0.01"]), 8, "cuda", a))
    assert ref.state["reference"] == 2 * a.params / 8  # stored in model.dtype (bf16)
    assert ref.peak.total > mem.peak.total


def test_gradients_stay_through_forward_only_with_several_micro_batches() -> None:
    cfg = load_config(ROOT / "configs" / "8b_dense.toml")
    a = arch("llama-3.1-8b")
    one = shape_of(with_changes(cfg, ["actor.micro_batch_size=16"]), 8, "cuda", a)  # 32·8/2/8 = 16 rows per rank
    four = shape_of(with_changes(cfg, ["actor.micro_batch_size=4"]), 8, "cuda", a)
    assert (one.micro_batches, four.micro_batches) == (1, 4)
    fwd = {m: next(p for p in trainer_memory(a, s).phases if p.name == "forward: log-probs") for m, s in
           ((1, one), (4, four))}  # fmt: skip
    assert "gradients" not in fwd[1].parts and fwd[4].parts["gradients"] == 4 * a.params / 8


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_every_shipped_config_has_a_plan_that_fits(path: Path) -> None:
    cfg = load_config(path)
    onegpu = path.stem.endswith("_onegpu")  # `molt-hpc run` on a one-GPU machine: both pools share it
    plan, _ = plan_config(cfg, local=path.stem == "tiny_cpu" or onegpu, gpus=1 if onegpu else 0)
    assert plan.fits, [(c.what, c.need / GIB, c.limit / GIB) for c in plan.checks]
    assert plan.runnable, plan.blockers


def test_the_seeds_405b_counts_do_not_fit_and_the_first_fix_does() -> None:
    seed = ["slurm.actor.nodes=4", "actor.offload='none'"]
    cfg = load_config(ROOT / "configs" / "405b_moe.toml", seed)
    plan, suggestions = plan_config(cfg, local=False)
    trainer = plan.check("trainer GPU")
    assert not trainer.ok and trainer.need > 16 * plan.arch.params / 32  # the state alone is 16 B/param over 32
    assert suggestions and suggestions[0].fits
    assert all(min(s.effect.values()) < 0 for s in suggestions)
    again, _ = plan_config(load_config(ROOT / "configs" / "405b_moe.toml", seed + suggestions[0].changes), local=False)
    assert again.fits and again.check("trainer GPU").need == suggestions[0].plan.check("trainer GPU").need


def test_a_multi_node_engine_replicates_the_dense_part_and_splits_the_experts() -> None:
    cfg = load_config(ROOT / "configs" / "1t_moe.toml")
    plan, _ = plan_config(cfg, local=False)
    a, eng, e = plan.arch, cfg.engines, plan.engines
    dense = a.params - a.expert_params
    assert e.weights == 2 * (dense / eng.tensor_parallel + a.expert_params / (eng.tensor_parallel * eng.data_parallel))
    assert (plan.placement.engines, e.gpus_per_engine, e.replicas) == (4, 32, 4)
    assert e.kv_bytes_per_token == a.kv_bytes_per_token(eng.tensor_parallel, 2)  # each replica its own cache
    assert e.wanted_sequences == -(-cfg.rollout.groups_in_flight * cfg.rollout.n_samples // (4 * 4))
    one_node = ["engines.nodes_per_engine=1", "engines.data_parallel=1", "engines.count=1", "slurm.engines.nodes=16"]
    alone, suggestions = plan_config(load_config(ROOT / "configs" / "1t_moe.toml", one_node), local=False)
    assert alone.engines.weights == 2 * a.params / 8 and not alone.check("engine GPU").ok
    assert not alone.blockers  # spanning nodes is a change of config now, not a missing feature
    assert suggestions[0].fits and "engines.nodes_per_engine=2" in suggestions[0].changes
    assert suggestions[0].plan.placement.engine_gpus == alone.placement.engine_gpus  # the same engine GPUs


def test_host_memory_is_this_machines_for_a_local_run_unless_set() -> None:
    def host_limit(sets: list[str], local: bool) -> float:
        plan, _ = plan_config(load_config(ROOT / "configs/tiny_cpu.toml", sets), local=local)
        return next(c.limit for c in plan.checks if c.what == "host memory per actor node")

    machine = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert host_limit([], local=True) == machine
    assert host_limit([], local=False) == 1800 * GIB  # a Slurm node, whatever this machine has
    assert host_limit(["plan.host_memory_gib=3.5"], local=True) == 3.5 * GIB
    assert host_limit(["plan.host_memory_gib=3.5"], local=False) == 3.5 * GIB


def test_architecture_must_agree_with_the_model_directory(tmp_path: Path) -> None:
    shape = json.loads((MODELS / "smollm2-135m" / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(shape))
    same = arch_of(ModelConfig(path=str(tmp_path), architecture=str(MODELS / "smollm2-135m")))
    assert same.source == str(tmp_path / "config.json")
    (tmp_path / "config.json").write_text(json.dumps({**shape, "num_hidden_layers": 12}))
    with pytest.raises(ValueError, match="describe different models"):
        arch_of(ModelConfig(path=str(tmp_path), architecture=str(MODELS / "smollm2-135m")))
    with pytest.raises(ValueError, match=r"missing does not exist; .* set model\.architecture"):
        arch_of(ModelConfig(path=str(tmp_path / "missing")))


@pytest.mark.slow
def test_plan_command_reports_and_exits_by_verdict() -> None:
    ok = molt("plan", "configs/8b_dense.toml")
    assert ok.returncode == 0, ok.stderr
    assert "peak" in ok.stdout and "KV cache" in ok.stdout and "fits:" in ok.stdout
    bad = molt("plan", "configs/405b_moe.toml", "--set", "slurm.actor.nodes=4", "--set", "actor.offload='none'")
    assert bad.returncode == 1
    assert "does not fit" in bad.stdout and "changes that would help" in bad.stdout


TIGHT = ("--set", "plan.host_memory_gib=0.0001")
"""A host no actor fits on: the plan refuses the tiny config."""


@pytest.mark.slow
def test_run_refuses_in_one_line_after_the_pre_flight(tmp_path: Path) -> None:
    run = molt("run", *TIGHT, "--set", f"run.root={tmp_path}")
    assert run.returncode == 2 and "plan: does not fit: host memory per actor node" in run.stderr
    # The pre-flight comes first: a placeholder weights path is refused before any plan is made.
    placeholder = molt(
        "submit", "configs/8b_dense.toml", "--set", "plan.gpu_memory_gib=20", "--set", f"run.root={tmp_path}"
    )
    assert placeholder.returncode == 2 and "plan:" not in placeholder.stderr and "model.path" in placeholder.stderr
    assert list(tmp_path.iterdir()) == []  # refused before a run directory was made


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("sbatch") is None, reason="submit plans only where sbatch is on PATH (slurm-wlm)")
def test_submit_refuses_in_one_line(tmp_path: Path) -> None:
    result = molt("submit", "configs/tiny_cpu.toml", *TIGHT, "--set", f"run.root={tmp_path}")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert (
        len(lines) == 2
        and lines[0].startswith("plan: does not fit: host memory per actor node")
        and "--no-plan" in lines[1]
    )
    assert list(tmp_path.iterdir()) == []


def test_dry_run_renders_and_prints_the_verdict() -> None:
    tight = ("--set", "actor.device='cuda'", "--set", "plan.gpu_memory_gib=0.01")  # a GPU no trainer fits on
    result = molt("submit", "configs/tiny_cpu.toml", *tight, "--dry-run")
    assert result.returncode == 0 and result.stdout.startswith("#!") and "#SBATCH hetjob" in result.stdout
    (verdict,) = result.stderr.strip().splitlines()  # only printed: a dry run refuses nothing the plan says
    assert verdict.startswith("plan: does not fit: trainer GPU needs")
    # the shipped 405B config's placeholder weights path: the pre-flight's one line (submit would refuse
    # it), the script all the same, and no plan of an input that is refused
    small = ("--set", "slurm.actor.nodes=4", "--set", "actor.offload='none'")
    placeholder = molt("submit", "configs/405b_moe.toml", *small, "--dry-run")
    assert placeholder.returncode == 2 and placeholder.stdout.startswith("#!")
    (error,) = placeholder.stderr.strip().splitlines()
    assert error.startswith("error: model.path = '/path/to/your/")
