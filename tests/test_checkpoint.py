"""Checkpoint files: verification, atomic publication, pruning, refusing bad input, and kill -9 mid-save.

The kill test forks one worker per kill point from a process that imported torch once; each child
runs a real world of one (gloo), loads `latest`, then dies by SIGKILL at a chosen point of the next
save. `latest` must always name a whole, loadable checkpoint.
"""

import json
import math
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from molt_hpc import checkpoint as ck
from tests.conftest import ROOT


def _tensors(n: int = 3, rows: int = 4):
    import torch

    return {f"w{i}": torch.arange(rows * 2, dtype=torch.float32).reshape(rows, 2) + i for i in range(n)}


def _fake_checkpoint(root: Path, step: int, keep_last: int = 2) -> Path:
    tmp = ck.begin(root, step)
    tensors = _tensors()
    weight_map = ck.write_shard(tmp / "policy", 0, 2, dict(list(tensors.items())[:2]))
    weight_map |= ck.write_shard(tmp / "policy", 1, 2, dict(list(tensors.items())[2:]))
    ck.write_index(tmp / "policy", weight_map, 3 * 8 * 4)
    ck.write_json(tmp / ck.RUN_STATE, {"step": step})
    ck.write_manifest(tmp)
    return ck.publish(root, tmp, step, keep_last)


def test_publish_points_latest_at_the_newest_and_keeps_the_last(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    assert ck.latest_checkpoint(root) is None
    for step in (1, 2, 3):
        _fake_checkpoint(root, step)
    assert ck.latest_checkpoint(root) == root / "step_000003"
    assert sorted(p.name for p in root.iterdir() if p.name != ck.LOCK) == ["latest", "step_000002", "step_000003"]
    ck.begin(root, 4)  # an interrupted save leaves its temporary directory ...
    _fake_checkpoint(root, 4)  # ... which the next save removes
    assert not list(root.glob(".tmp.*"))
    assert ck.read_run_state(ck.latest_checkpoint(root)) == {"step": 4}


def test_verify_names_a_corrupt_or_truncated_file(tmp_path: Path) -> None:
    path = _fake_checkpoint(tmp_path, 1)
    ck.verify(path)
    shard = path / "policy" / ck.shard_name(0, 2)
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # one flipped bit pattern in the tensor bytes: the header is still fine
    shard.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=rf"{shard}.*corrupt.*sha256"):
        ck.verify(path)
    shard.write_bytes(bytes(data[:-5]))
    with pytest.raises(ValueError, match=rf"{shard}"):
        ck.verify(path)
    with pytest.raises(ValueError, match="corrupt: its header describes"):
        ck.safetensors_shapes(shard)
    shard.write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{nope")
    with pytest.raises(ValueError, match="header is not JSON"):
        ck.safetensors_shapes(shard)


def test_latest_naming_a_partial_checkpoint_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "step_000001").mkdir()
    (tmp_path / "latest").write_text("step_000001\n")
    with pytest.raises(ValueError, match="not a whole checkpoint"):
        ck.latest_checkpoint(tmp_path)


def _other_model(tiny_model_dir: Path, out: Path) -> Path:
    """A copy of the tiny model with one tensor of another shape (a checkpoint of another model)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(tiny_model_dir, out)
    tensors = load_file(str(out / "model.safetensors"))
    tensors["model.norm.weight"] = tensors["model.norm.weight"][:-1].clone()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def test_checkpoint_of_another_model_is_refused_naming_file_and_tensor(tiny_model_dir: Path, tmp_path: Path) -> None:
    from molt_hpc.actor.build import check_checkpoint_model

    other = _other_model(tiny_model_dir, tmp_path / "other")
    check_checkpoint_model(tiny_model_dir, tiny_model_dir)
    with pytest.raises(ValueError, match=r"model\.safetensors: tensor model\.norm\.weight has shape \[127\].*another"):
        check_checkpoint_model(other, tiny_model_dir)


def test_bad_model_directories_fail_before_loading(tiny_model_dir: Path, tmp_path: Path) -> None:
    from molt_hpc.actor.build import check_weights  # what the trainer's `load_model` runs first

    with pytest.raises(ValueError, match="does not exist"):
        check_weights(tmp_path / "missing")
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ValueError, match=rf"{weights} is not a valid safetensors file|{weights} is corrupt"):
        check_weights(broken)


def test_resume_rules(tiny_model_dir: Path, tmp_path: Path) -> None:
    from molt_hpc.actor.rl import resume_point
    from tests.test_actor_support import make_run

    cfg, run = make_run(tmp_path, "r", tiny_model_dir)
    assert resume_point(cfg, run, tiny_model_dir, required=False) is None
    with pytest.raises(ValueError, match="nothing to resume"):
        resume_point(cfg, run, tiny_model_dir, required=True)
    tmp = ck.begin(run.checkpoints, 5)
    _other_model(tiny_model_dir, tmp / "policy")
    ck.write_manifest(tmp)
    ck.publish(run.checkpoints, tmp, 5, keep_last=2)
    with pytest.raises(ValueError, match=r"tensor model\.norm\.weight has shape"):
        resume_point(cfg, run, tiny_model_dir, required=False)
    cfg.checkpoint.resume = "never"
    with pytest.raises(ValueError, match="already has checkpoint step_000005"):
        resume_point(cfg, run, tiny_model_dir, required=False)


def test_lr_schedule_follows_its_formulas() -> None:
    from molt_hpc.actor.build import lr_factor
    from molt_hpc.config.train import ActorConfig

    warm = ActorConfig(warmup_steps=4, lr_schedule="linear", min_lr_ratio=0.2)
    assert [lr_factor(s, warm, 14) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_factor(9, warm, 14) == pytest.approx(1 - 0.8 * 0.5)
    assert lr_factor(14, warm, 14) == pytest.approx(0.2)
    cos = ActorConfig(lr_schedule="cosine", min_lr_ratio=0.0)
    assert [lr_factor(s, cos, 4) for s in range(5)] == pytest.approx(
        [0.5 * (1 + math.cos(math.pi * s / 4)) for s in range(5)]
    )
    assert lr_factor(100, ActorConfig(), 10) == 1.0


# --- kill -9 during a save ---------------------------------------------------------------------------------

KILL_POINTS = ["second_shard", "manifest", "latest", None]


def _arm(point: str | None) -> None:
    """Make this process SIGKILL itself at `point` of the next save."""
    if point is None:
        return
    die = lambda: os.kill(os.getpid(), signal.SIGKILL)  # noqa: E731
    if point == "second_shard":
        write = ck.write_shard
        ck.write_shard = lambda d, i, n, t: die() if i == 1 else write(d, i, n, t)
    elif point == "manifest":
        ck.write_manifest = lambda d: die()
    else:
        write = ck.atomic_write
        ck.atomic_write = lambda path, data, mode=0o600: die() if Path(path).name == "latest" else write(path, data)


def _child(root: Path, base: Path, point: str | None, report: Path) -> None:
    import torch

    from molt_hpc.actor import build, state
    from molt_hpc.actor.world import init_world
    from molt_hpc.config import MoltConfig
    from molt_hpc.config.train import ActorConfig

    world = init_world(ActorConfig())
    latest = ck.latest_checkpoint(root)
    if latest is not None:
        ck.verify(latest)
    model = build.load_model(latest / "policy" if latest else base, MoltConfig(), world, "policy")
    opt = build.build_optimizer(model, ActorConfig(), 1e-2)
    part = state.Trainable("policy", model, opt, build.build_scheduler(opt, ActorConfig(), 10))
    step = 0
    if latest is not None:
        step = state.restore(world, latest, [part], seed=0)["step"]
    with open(report, "a") as f:
        f.write(json.dumps({"point": point, "latest": latest and latest.name, "adam_steps": _adam_steps(opt)}) + "\n")
    model(input_ids=torch.tensor([[5, 6, 7, 8]])).logits.float().pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    _arm(point)
    state.save(world, root, step + 1, [part], {"version": step + 1}, tokenizer_src=base, shard_bytes=1 << 20,
               keep_last=3)  # fmt: skip
    torch.distributed.destroy_process_group()


def _adam_steps(opt) -> float:
    steps = [float(s["step"]) for s in opt.state.values()]
    return max(steps) if steps else 0.0


def worker(root: Path, base: Path, report: Path) -> None:
    """Fork one child per kill point (imports are paid once); print each child's fate."""
    import torch
    import transformers.models.qwen3.modeling_qwen3  # noqa: F401 - imported before forking, so children start fast

    import molt_hpc.actor.state  # noqa: F401

    torch.set_num_threads(1)
    for point in ["first", *KILL_POINTS]:
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                _child(root, base, None if point == "first" else point, report)
            except BaseException as err:  # report the child's error to the parent instead of unwinding twice
                print(f"child {point}: {err!r}", file=sys.stderr, flush=True)
                code = 1
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"point": point, "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
                          "exit": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None}), flush=True)  # fmt: skip


def test_kill_9_during_a_save_leaves_a_loadable_latest(tiny_model_dir: Path, tmp_path: Path) -> None:
    root, report = tmp_path / "checkpoints", tmp_path / "report.jsonl"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    env = {k: v for k, v in env.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.test_checkpoint", str(root), str(tiny_model_dir), str(report)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    fates = {r["point"]: r for r in map(json.loads, proc.stdout.splitlines())}
    assert fates["first"]["exit"] == 0 and fates[None]["exit"] == 0, proc.stderr[-4000:]
    for point in KILL_POINTS[:-1]:
        assert fates[point]["signal"] == signal.SIGKILL, (point, proc.stderr[-4000:])
    seen = [json.loads(line) for line in report.read_text().splitlines()]
    # Every child after the first found step 1 as latest, whole, with the optimizer state of one update.
    assert [(r["latest"], r["adam_steps"]) for r in seen] == [(None, 0.0)] + [("step_000001", 1.0)] * 4
    latest = ck.latest_checkpoint(root)
    assert latest == root / "step_000002"
    ck.verify(latest)
    assert not list(root.glob(".tmp.*"))
    assert ck.read_run_state(latest)["version"] == 2


if __name__ == "__main__":
    from molt_hpc.log import end_process

    worker(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))
    end_process(0)  # past the interpreter teardown, which torch's gloo threads do not survive
