"""The actor pool end to end: `torchrun jobs/actor.py` worlds of 1 and 2 gloo ranks fed by a real buffer.

Run A trains 2 steps on 2 ranks without interruption, one sample per padded row. Run B trains the
same first step on 1 rank with packed rows (the default), is asked to checkpoint (SIGUSR1) and to
stop (SIGTERM), then resumes on 2 ranks for step 2. The same global batch gives the same loss on 1
and 2 ranks, packed or not, and the resumed run ends where run A ended: same weights, same
optimizer state. Run CP trains run A's first step on the 2 ranks as one CP group.
"""

import json
import os
import signal
import time
from pathlib import Path

import pytest

from molt_hpc import checkpoint as ck
from molt_hpc.buffer import acked_ids
from molt_hpc.log import read_metrics
from tests.test_actor_support import make_run, put_groups, sample_groups, torchrun

OVERRIDES = [
    "rollout.n_samples=4", "actor.groups_per_step=2", "actor.micro_batch_size=3", "run.steps=2",
    "algorithm.kl_coef=0.05", "checkpoint.keep_last=2",
]  # fmt: skip


@pytest.fixture(scope="module")
def groups(tiny_model_dir):
    out = sample_groups(tiny_model_dir, 4, 4, seed=7)
    # The first group also reports 4 samples of groups that dynamic sampling dropped (rewards 3.0 in all).
    own = sum(s.reward for s in out[0].samples)
    out[0].meta["finished_rewards"] = [own + 3.0, len(out[0].samples) + 4]
    return out


@pytest.fixture(scope="module")
def run_a(tmp_path_factory, tiny_model_dir, groups):
    """2 ranks, 2 steps, a checkpoint after each, padded rows."""
    sets = [*OVERRIDES, "checkpoint.interval=1", "actor.packing='off'"]
    cfg, run = make_run(tmp_path_factory.mktemp("a"), "a", tiny_model_dir, sets)
    put_groups(cfg, run, groups)
    code, log = torchrun(run.path, 2)
    assert code == 0, log[-4000:]
    return cfg, run


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _wait_for(what, timeout: float = 120.0, proc=None):
    deadline = time.monotonic() + timeout
    while not (result := what()):
        assert proc is None or proc.poll() is None, "the trainer exited early"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)
    return result


@pytest.fixture(scope="module")
def run_b(tmp_path_factory, tiny_model_dir, groups):
    """1 rank trains step 1 on the first two groups, checkpoints on SIGUSR1, stops on SIGTERM."""
    cfg, run = make_run(tmp_path_factory.mktemp("b"), "b", tiny_model_dir, [*OVERRIDES, "checkpoint.interval=0"])
    put_groups(cfg, run, groups[:2])
    proc = torchrun(run.path, 1, wait=False)
    try:
        _wait_for(lambda: read_metrics(run.metrics, "actor"), proc=proc)
        trained_unacked = acked_ids(run.buffer)  # no checkpoint yet: the trained groups stay claimed
        (worker,) = _children(proc.pid)
        os.kill(worker, signal.SIGUSR1)
        _wait_for(lambda: ck.latest_checkpoint(run.checkpoints), proc=proc)
        os.kill(worker, signal.SIGTERM)
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert code == 0
    assert trained_unacked == []
    assert sorted(acked_ids(run.buffer)) == [g.group_id for g in groups[:2]]
    return cfg, run


@pytest.fixture(scope="module")
def run_cp(tmp_path_factory, tiny_model_dir, groups):
    """2 ranks as one CP group (actor.cp = 2), packed rows, activation checkpointing: run A's first step."""
    sets = [*OVERRIDES, "run.steps=1", "checkpoint.interval=0", "actor.cp=2", "actor.packing='on'",
            "actor.activation_checkpointing=true"]  # fmt: skip
    cfg, run = make_run(tmp_path_factory.mktemp("cp"), "cp", tiny_model_dir, sets)
    put_groups(cfg, run, groups[:2])
    code, log = torchrun(run.path, 2)
    assert code == 0, log[-4000:]
    return cfg, run, log


def test_context_parallel_with_packed_rows_gives_the_same_loss(run_a, run_cp) -> None:
    a = read_metrics(run_a[1].metrics, "actor")
    c = read_metrics(run_cp[1].metrics, "actor")
    assert [r["step"] for r in c] == [1]
    for key in ("loss", "policy_loss", "grad_norm", "entropy", "reward", "tokens"):
        assert c[0][key] == pytest.approx(a[0][key], rel=1e-5, abs=1e-7), key
    assert "micro-batches: packed" in run_cp[2] and "context parallel 2" in run_cp[2]


def test_one_rank_and_two_ranks_give_the_same_loss(run_a, run_b) -> None:
    a = read_metrics(run_a[1].metrics, "actor")
    b = read_metrics(run_b[1].metrics, "actor")
    assert [r["step"] for r in a] == [1, 2] and [r["step"] for r in b] == [1]
    for key in ("loss", "policy_loss", "grad_norm", "entropy", "reward"):
        assert b[0][key] == pytest.approx(a[0][key], rel=1e-5, abs=1e-7), key
    assert a[0]["kl"] == 0.0 < a[1]["kl"]  # the reference is the initial policy


def test_metrics_record_what_a_step_did(run_a, groups) -> None:
    rec = read_metrics(run_a[1].metrics, "actor")[0]
    for key in ("version", "loss", "reward", "kl", "entropy", "clip_frac", "grad_norm", "lr", "ratio_mean",
                "ratio_min", "ratio_max", "tokens_per_s", "staleness", "buffer_pending", "refit_s"):  # fmt: skip
        assert key in rec, key
    assert rec["version"] == 1 and rec["staleness"] == {"0": 2}
    # Step 1 trained groups 0 and 1: `reward_trained` is their samples' mean; `reward` also counts the
    # 4 dropped samples group 0 reports.
    trained = [s.reward for g in groups[:2] for s in g.samples]
    assert rec["reward_trained"] == pytest.approx(sum(trained) / len(trained))
    assert rec["reward"] == pytest.approx((sum(trained) + 3.0) / (len(trained) + 4))
    # a CPU trainer: host peak memory of the step (a torch process with the tiny model: a few hundred MB),
    # and no GPU allocator peaks
    assert 0.1 < rec["mem_peak_host_rss_gb"] < 8 and "mem_peak_allocated_gb" not in rec
    # The trainer's log-probs equal the sampler's: the first ratio is 1 up to float rounding.
    assert abs(rec["ratio_max"] - 1) < 1e-5 and abs(rec["ratio_min"] - 1) < 1e-5


def test_a_finished_run_is_checkpointed_acked_and_marked_done(run_a, groups, tiny_model_dir) -> None:
    import torch
    from safetensors.torch import load_file

    _, run = run_a
    assert (run.path / "control" / "done").exists()
    assert sorted(p.name for p in run.checkpoints.glob("step_*")) == ["step_000001", "step_000002"]
    assert ck.latest_checkpoint(run.checkpoints).name == "step_000002"
    assert sorted(acked_ids(run.buffer)) == [g.group_id for g in groups]
    assert ck.read_run_state(run.checkpoints / "step_000002")["trained_groups"] == [g.group_id for g in groups[2:]]
    base = load_file(str(tiny_model_dir / "model.safetensors"))
    step1 = {}
    for f in (run.checkpoints / "step_000001" / "policy").glob("*.safetensors"):
        step1 |= load_file(str(f))
    assert set(step1) == set(base)
    assert [n for n in base if torch.equal(base[n], step1[n])] == []


def test_signals_checkpoint_and_stop_at_a_step_boundary(run_b) -> None:
    _, run = run_b
    assert ck.latest_checkpoint(run.checkpoints).name == "step_000001"
    assert not (run.path / "control" / "done").exists()
    assert ck.read_run_state(run.checkpoints / "step_000001")["world_size"] == 1


def _optimizer_state(ckpt: Path, out: Path) -> dict:
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(ckpt / "optim"), str(out))
    return torch.load(out, weights_only=False)["policy"]["state"]


def test_resume_on_two_ranks_continues_to_the_same_state(run_a, run_b, groups, tmp_path) -> None:
    import torch
    from safetensors.torch import load_file

    cfg, run = run_b
    put_groups(cfg, run, groups[2:])
    code, log = torchrun(run.path, 2, "--resume")
    assert code == 0, log[-4000:]
    assert "saved by 1 ranks and resumes on 2" in log
    assert [r["step"] for r in read_metrics(run.metrics, "actor")] == [1, 2]
    assert (run.path / "control" / "done").exists()
    a2, b2 = run_a[1].checkpoints / "step_000002", run.checkpoints / "step_000002"
    # Step 1 ran on 1 rank here and on 2 ranks in run A: gradients summed in another order differ in
    # the last bits, which Adam can amplify where second moments are tiny. Each Adam update moves a
    # weight by about the learning rate, so a hundredth of it bounds that rounding.
    atol = cfg.actor.lr / 100
    for f in sorted((a2 / "policy").glob("*.safetensors")):
        want, got = load_file(str(f)), load_file(str(b2 / "policy" / f.name))
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=0, atol=atol)
    sa, sb = _optimizer_state(a2, tmp_path / "a.pt"), _optimizer_state(b2, tmp_path / "b.pt")
    assert set(sa) == set(sb)
    for name in sa:
        assert float(sa[name]["step"]) == float(sb[name]["step"]) == 2.0
        for key in ("exp_avg", "exp_avg_sq"):
            # The same rounding, relative to the tensor's scale: a lost or misplaced moment is O(1) of it.
            scale = float(sa[name][key].abs().max())
            torch.testing.assert_close(sb[name][key], sa[name][key], rtol=0, atol=1e-4 * scale)
    state = json.loads((b2 / "run_state.json").read_text())
    assert state["world_size"] == 2 and state["version"] == 2
