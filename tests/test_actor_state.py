"""The trainer's state in a real 2-rank gloo world: what one step changes, and save → load → save.

The trainer here writes its checkpoints behind the training (`checkpoint.background`, every step): the
step's checkpoint must be byte-identical to `state.save`'s of the same state after a resume, and a save
behind whose weights and optimizer state change while it is written must still hold the state it started
from (the same bytes again).

The worker half of this file runs under torchrun (`python -m torch.distributed.run ... -m
tests.test_actor_state RUN_DIR OUT`); the test half prepares the run and checks what it wrote.
"""

import filecmp
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.test_actor_support import make_run, put_groups, sample_groups

OVERRIDES = [
    "algorithm.advantage='gae'", "algorithm.kl_coef=0.05", "rollout.n_samples=4", "actor.groups_per_step=2",
    "actor.micro_batch_size=3", "actor.mini_batches=2", "checkpoint.interval=1", "checkpoint.background=true",
    "checkpoint.shard_mb=1",
]  # fmt: skip
RUN_STATE_OWN = ("step", "world_size", "rng", "schedulers", "optimizer")  # what `state.save` adds itself


def _full(model) -> dict:
    from torch.distributed.tensor import DTensor

    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}


def _control_requests(control, world) -> list:
    """(checkpoint, stop) every rank sees after: rank 0's control file, SIGUSR1 to rank 1 alone, nothing,
    rank 0's stop file; and whether the checkpoint file outlived its serving (rank 0, which owns it)."""
    import torch.distributed as dist

    from molt_hpc.actor.world import gather_all

    def ask():
        dist.barrier()
        req = control.poll()
        control.served(req)
        return [req.checkpoint, req.stop]

    control.dir.mkdir(exist_ok=True)
    if world.is_main:
        (control.dir / "checkpoint").touch()
    seen = [ask(), (control.dir / "checkpoint").exists() if world.is_main else None]
    if world.rank == 1:
        os.kill(os.getpid(), signal.SIGUSR1)
    seen.append(ask())
    seen.append(ask())
    if world.is_main:
        (control.dir / "stop").touch()
    seen.append(ask())
    return gather_all(seen)


def worker(run_dir: Path, out: Path) -> None:
    """One step, then the checkpoint, then a second trainer resumed from it saving again elsewhere."""
    import torch
    from safetensors.torch import save_file

    from molt_hpc import checkpoint as ck
    from molt_hpc.actor import state
    from molt_hpc.actor.rl import RlTask
    from molt_hpc.actor.save_behind import SaveBehind
    from molt_hpc.actor.trainer import Trainer
    from molt_hpc.actor.world import init_world
    from molt_hpc.config import load_config
    from molt_hpc.log import setup_logging
    from molt_hpc.rundir import RunDir

    torch.set_num_threads(1)
    cfg = load_config(run_dir / "config.toml")
    world = init_world(cfg.actor)
    setup_logging(f"actor r{world.rank}")
    run = RunDir(run_dir)
    t = Trainer(cfg, run, world, RlTask(cfg, run, world), resume=False)
    groups, _ = t.task.next_batch(t.version, t.control)
    m = t.task.models
    models = {"policy": m.policy.model, "reference": m.reference, "critic": m.critic.model}
    before = {k: _full(m) for k, m in models.items()}
    t.train(groups, wait_s=0.0)
    after = {k: _full(m) for k, m in models.items()}
    t.checkpoint()
    if world.is_main:
        changed = {k: sorted(n for n in before[k] if not torch.equal(before[k][n], after[k][n])) for k in models}
        trainable = {k: sorted(n for n, p in m.named_parameters() if p.requires_grad) for k, m in models.items()}
        (out / "changes.json").write_text(json.dumps({"changed": changed, "trainable": trainable}))
        save_file(after["policy"], str(out / "policy_after.safetensors"))
    requests = _control_requests(t.control, world)
    if world.is_main:
        (out / "control.json").write_text(json.dumps(requests))
    again = Trainer(cfg, run, world, RlTask(cfg, run, world), resume=True)
    ckpt = ck.latest_checkpoint(run.checkpoints)
    extra = {k: v for k, v in ck.read_run_state(ckpt).items() if k not in RUN_STATE_OWN}
    how = {"tokenizer_src": again.base, "shard_bytes": cfg.checkpoint.shard_mb << 20, "keep_last": 2}
    state.save(world, out / "again", again.step, again.parts, extra, **how)
    saver = SaveBehind(world)
    saver.start(out / "behind", again.step, again.parts, extra, save_optimizer=True, **how)
    with torch.no_grad():  # the training moves on while the save is written
        for part in again.parts:
            for p in part.model.parameters():
                p.add_(1.0)
            for per_param in part.optimizer.state.values():
                for value in per_param.values():
                    value.add_(1.0)
    saver.wait()
    saver.close()
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def stepped(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("actor-state")
    cfg, run = make_run(root, "state", tiny_model_dir, OVERRIDES)
    put_groups(cfg, run, sample_groups(tiny_model_dir, 2, 4, seed=3))
    out = root / "out"
    out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "tests.test_actor_state", str(run.path), str(out)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return run, out


def test_one_step_changes_every_trainable_parameter_and_not_the_reference(stepped) -> None:
    _, out = stepped
    report = json.loads((out / "changes.json").read_text())
    changed, trainable = report["changed"], report["trainable"]
    assert trainable["policy"] and changed["policy"] == trainable["policy"]
    assert trainable["critic"] and changed["critic"] == trainable["critic"]
    assert "score.weight" in changed["critic"]  # the value head trained too
    assert trainable["reference"] == [] and changed["reference"] == []


def test_requests_reach_every_rank(stepped) -> None:
    _, out = stepped
    per_rank = json.loads((out / "control.json").read_text())
    expected = [[True, False], False, [True, False], [False, False], [False, True]]
    assert per_rank == [expected, [*expected[:1], None, *expected[2:]]]


def test_checkpoint_loads_in_transformers_as_is(stepped) -> None:
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run, out = stepped
    policy_dir = run.path / "checkpoints" / "step_000001" / "policy"
    index = json.loads((policy_dir / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1, "checkpoint.shard_mb = 1 must give several shards"
    model = AutoModelForCausalLM.from_pretrained(str(policy_dir), dtype=torch.float32, local_files_only=True)
    want = load_file(str(out / "policy_after.safetensors"))
    got = dict(model.named_parameters())
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert torch.equal(got[name].detach(), tensor), name
    tok = AutoTokenizer.from_pretrained(str(policy_dir), local_files_only=True)
    assert tok.decode(tok("Reverse: abc")["input_ids"]) == "Reverse: abc"


@pytest.mark.parametrize("again", ["again", "behind"])
def test_save_load_save_is_byte_identical(stepped, again) -> None:
    """The trainer's checkpoint (written behind its step) against `state.save`'s after a resume, and against
    a save behind whose state changed while it was written."""
    run, out = stepped
    first = run.path / "checkpoints" / "step_000001"
    second = out / again / "step_000001"
    files = sorted(str(p.relative_to(first)) for p in first.rglob("*") if p.is_file())
    assert files == sorted(str(p.relative_to(second)) for p in second.rglob("*") if p.is_file())
    assert {"optim/.metadata", "optim/__0_0.distcp", "optim/__1_0.distcp", "run_state.json"} <= set(files)
    assert any(f.startswith("critic/") for f in files)
    different = [f for f in files if not filecmp.cmp(first / f, second / f, shallow=False)]
    assert different == []


if __name__ == "__main__":
    from molt_hpc.log import end_process

    worker(Path(sys.argv[1]), Path(sys.argv[2]))
    end_process(0)  # past the interpreter teardown, which torch's gloo threads do not survive
