"""A LoRA policy in the FSDP2 trainer (2 gloo ranks, real peft): what trains, the reference, the checkpoint.

One step of the tiny model with `[actor.lora]` and a KL term, a checkpoint, and a second trainer resumed
from it saving again. Checked against independent computations: plain transformers forwards of the base,
and peft's own `PeftModel.from_pretrained` on the saved adapter directory.
"""

import filecmp
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.test_actor_support import make_run, put_groups, sample_groups

OVERRIDES = [
    "algorithm.kl_coef=0.05", "rollout.n_samples=4", "actor.groups_per_step=2", "actor.micro_batch_size=3",
    "checkpoint.interval=0", "actor.packing='off'", "actor.lora.rank=4", "actor.lora.alpha=8.0", "actor.lr=0.01",
]  # fmt: skip
PROBE = [2, 34, 32, 18, 31, 100, 57, 18, 40, 41]
RUN_STATE_OWN = ("step", "world_size", "rng", "schedulers", "optimizer")


def _full(model) -> dict:
    from torch.distributed.tensor import DTensor

    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}


def _logits(model, adapters: bool):
    """The probe's logits under `model` (every rank runs the forward: FSDP2 gathers per block)."""
    import torch

    from molt_hpc.actor import lora

    ids = torch.tensor([PROBE])
    with torch.no_grad(), lora.adapters_disabled(model) if not adapters else torch.enable_grad():
        return model(input_ids=ids, position_ids=torch.arange(len(PROBE))[None]).logits[0].float()


def worker(run_dir: Path, out: Path) -> None:
    import torch
    from safetensors.torch import save_file

    from molt_hpc import checkpoint as ck
    from molt_hpc.actor import state
    from molt_hpc.actor.rl import RlTask
    from molt_hpc.actor.trainer import Trainer
    from molt_hpc.actor.world import close_world, init_world
    from molt_hpc.config import load_config
    from molt_hpc.log import setup_logging
    from molt_hpc.rundir import RunDir

    torch.set_num_threads(1)
    cfg = load_config(run_dir / "config.toml")
    world = init_world(cfg.actor)
    setup_logging(f"actor r{world.rank}")
    run = RunDir(run_dir)
    t = Trainer(cfg, run, world, RlTask(cfg, run, world), resume=False)
    policy = t.task.models.policy.model
    groups, _ = t.task.next_batch(t.version, t.control)
    before = _full(policy)
    t.train(groups, wait_s=0.0)
    t.train(groups, wait_s=0.0)  # a second step: B moved in the first, so A gets gradients now
    after = _full(policy)
    logits = {"policy": _logits(policy, True), "reference": _logits(policy, False)}
    t.checkpoint()
    if world.is_main:
        report = {
            "changed": sorted(n for n in before if not torch.equal(before[n], after[n])),
            "trainable": sorted(n for n, p in policy.named_parameters() if p.requires_grad),
            "dtypes": {n: str(p.dtype) for n, p in policy.named_parameters()},
            "optimized": sum(len(g["params"]) for g in t.task.models.policy.optimizer.param_groups),
            "reference_is_policy": t.task.models.reference is policy,
        }
        (out / "report.json").write_text(json.dumps(report))
        save_file(logits, str(out / "logits.safetensors"))
    t.close()
    again = Trainer(cfg, run, world, RlTask(cfg, run, world), resume=True)
    ckpt = ck.latest_checkpoint(run.checkpoints)
    extra = {k: v for k, v in ck.read_run_state(ckpt).items() if k not in RUN_STATE_OWN}
    state.save(
        world, out / "again", again.step, again.parts, extra,
        tokenizer_src=again.base, shard_bytes=cfg.checkpoint.shard_mb << 20, keep_last=2,
    )  # fmt: skip
    again.close()
    close_world()  # the trainer's own ordered end: a barrier, then the groups go


@pytest.fixture(scope="module")
def stepped(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("lora-actor")
    cfg, run = make_run(root, "lora", tiny_model_dir, OVERRIDES)
    put_groups(cfg, run, sample_groups(tiny_model_dir, 4, 4, seed=3))
    out = root / "out"
    out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "tests.test_lora_actor", str(run.path), str(out)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return run, out


def test_only_the_adapters_train_and_the_base_stays_in_the_model_dtype(stepped) -> None:
    _, out = stepped
    report = json.loads((out / "report.json").read_text())
    trainable, changed = report["trainable"], report["changed"]
    linears = 7 * 2  # q, k, v, o, gate, up, down in each of the tiny model's 2 decoder blocks
    assert len(trainable) == 2 * linears and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert changed == trainable  # every adapter moved (B in step 1, A too in step 2), nothing else
    assert report["optimized"] == len(trainable)
    assert report["reference_is_policy"]  # no second copy of the weights
    assert all(d == "torch.float32" for d in report["dtypes"].values())  # the tiny model's dtype is float32


def test_reference_is_the_base_and_the_policy_is_what_peft_loads(stepped, tiny_model_dir) -> None:
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file

    from molt_hpc.models import load_causal_lm

    run, out = stepped
    logits = load_file(str(out / "logits.safetensors"))
    ids = torch.tensor([PROBE])
    pos = torch.arange(len(PROBE))[None]
    base = load_causal_lm(tiny_model_dir)
    with torch.no_grad():
        plain = base(input_ids=ids, position_ids=pos).logits[0].float()
    assert torch.allclose(logits["reference"], plain, atol=1e-5, rtol=0)
    policy_dir = run.checkpoints / "step_000002" / "policy"
    assert sorted(p.name for p in policy_dir.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((policy_dir / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8.0, "LORA")
    assert config["base_model_name_or_path"] == str(tiny_model_dir)
    peft_model = PeftModel.from_pretrained(base, str(policy_dir))
    with torch.no_grad():
        loaded = peft_model(input_ids=ids, position_ids=pos).logits[0].float()
    assert torch.allclose(logits["policy"], loaded, atol=1e-5, rtol=0)
    assert (logits["policy"] - plain).abs().max() > 1e-3  # the adapters changed the policy


def test_resume_restores_adapters_optimizer_and_rng_exactly(stepped) -> None:
    run, out = stepped
    first = run.path / "checkpoints" / "step_000002"
    second = out / "again" / "step_000002"
    files = sorted(str(p.relative_to(first)) for p in first.rglob("*") if p.is_file())
    assert files == sorted(str(p.relative_to(second)) for p in second.rglob("*") if p.is_file())
    assert {"optim/.metadata", "policy/adapter_model.safetensors", "run_state.json"} <= set(files)
    assert [f for f in files if not filecmp.cmp(first / f, second / f, shallow=False)] == []


def test_model_merge_writes_the_policy_as_a_plain_model(stepped, tmp_path) -> None:
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from tests.conftest import BIN

    run, out = stepped
    merged = tmp_path / "merged"
    proc = subprocess.run([str(BIN / "molt-hpc"), "model", "merge", str(run.path), str(merged)],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    model = AutoModelForCausalLM.from_pretrained(str(merged), local_files_only=True)
    assert not any("lora" in n or "base_layer" in n for n, _ in model.named_parameters())
    ids = torch.tensor([PROBE])
    with torch.no_grad():
        logits = model(input_ids=ids, position_ids=torch.arange(len(PROBE))[None]).logits[0].float()
    assert torch.allclose(logits, load_file(str(out / "logits.safetensors"))["policy"], atol=1e-5, rtol=0)
    assert (merged / "tokenizer.json").is_file()
    again = subprocess.run([str(BIN / "molt-hpc"), "model", "merge", str(merged), str(tmp_path / "x")],
                           capture_output=True, text=True, timeout=120)  # fmt: skip
    assert again.returncode == 2 and "no LoRA adapters" in again.stderr


if __name__ == "__main__":
    from molt_hpc.log import end_process

    worker(Path(sys.argv[1]), Path(sys.argv[2]))
    end_process(0)  # past the interpreter teardown, which torch's threads do not survive (the trainer's own exit)
