"""W&B (offline mode) and TensorBoard fed from metrics.jsonl, read back from the files they write."""

import glob
import struct
from pathlib import Path

import pytest

from molt_hpc.config import load_config, to_toml
from molt_hpc.config.infra import LoggingConfig
from molt_hpc.log import MetricsWriter
from molt_hpc.rundir import create_run_dir
from molt_hpc.trackers import Trackers, check_trackers
from tests.conftest import molt

wandb = pytest.importorskip("wandb")
pytest.importorskip("tensorboard")
pytestmark = pytest.mark.timeout(300)
BOTH = LoggingConfig.model_validate({"wandb": {"mode": "offline", "project": "test"}, "tensorboard": {}})


def wandb_history(run_dir: Path) -> tuple[set[str], list[dict[str, float]]]:
    """(run ids, history rows) of every offline W&B run under `run_dir`, read from W&B's record log:
    a `:W&B` header, then leveldb-log records (crc32, length, type) in 32 KiB blocks, each payload a
    `wandb_internal_pb2.Record`."""
    from wandb.proto import wandb_internal_pb2 as pb

    ids, rows = set(), []
    for path in sorted(glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))):
        ids.add(Path(path).stem.removeprefix("run-"))
        data, pos, buf = Path(path).read_bytes(), 7, b""
        assert data[:4] == b":W&B"
        while pos + 7 <= len(data):
            left = 32768 - pos % 32768
            _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7]) if left >= 7 else (0, 0, 0)
            if kind == 0:  # block trailer padding
                pos += left
                continue
            buf = data[pos + 7 : pos + 7 + length] if kind in (1, 2) else buf + data[pos + 7 : pos + 7 + length]
            pos += 7 + length
            if kind in (1, 4):
                rec = pb.Record.FromString(buf)
                if rec.WhichOneof("record_type") == "history":
                    items = {i.key or "/".join(i.nested_key): i.value_json for i in rec.history.item}
                    rows.append({k: float(v) for k, v in items.items() if not k.startswith("_")})
    return ids, rows


def tensorboard_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

    mux = EventMultiplexer().AddRunsFromDirectory(str(log_dir)).Reload()
    out: dict[str, list[tuple[int, float]]] = {}
    for run in mux.Runs():
        for tag in mux.GetAccumulator(run).Tags()["scalars"]:
            out.setdefault(tag, []).extend((e.step, e.value) for e in mux.Scalars(run, tag))
    return {tag: sorted(v) for tag, v in out.items()}


def actor_record(step: int) -> dict[str, float]:
    return {"step": step, "reward": step / 10, "kl": 0.5 / step, "note": "text is not a metric"}


def test_records_reach_both_trackers_once_across_a_resume(tmp_path: Path) -> None:
    run = create_run_dir(tmp_path, "run", to_toml(load_config(None)))
    metrics = MetricsWriter(run.metrics, "actor")
    rollout = MetricsWriter(run.metrics, "rollout")
    trackers = Trackers(BOTH, run, "run")
    for step in (1, 2, 3):
        metrics.write(actor_record(step))
        rollout.write({"groups_per_s": float(step), "reward": 0.2})
    assert trackers.update() == 6 and trackers.update() == 0
    trackers.close()
    for step in (4, 5):  # a resumed run: a new launcher, the same run directory, the same file
        metrics.write(actor_record(step))
    resumed = Trackers(BOTH, run, "run")
    assert resumed.update() == 2
    resumed.close()

    ids, rows = wandb_history(run.path)
    assert len(ids) == 1  # the resumed launcher continued the same W&B run
    actor = sorted((r["actor/step"], r["actor/reward"], r["actor/kl"]) for r in rows if "actor/step" in r)
    assert actor == [(s, s / 10, 0.5 / s) for s in range(1, 6)]  # every step once, values as written
    assert sorted(r["rollout/groups_per_s"] for r in rows if "rollout/groups_per_s" in r) == [1.0, 2.0, 3.0]
    assert not any("actor/note" in r for r in rows)
    scalars = tensorboard_scalars(run.path / "tensorboard")
    assert scalars["actor/reward"] == [(s, pytest.approx(s / 10)) for s in range(1, 6)]
    assert [v for _, v in scalars["rollout/groups_per_s"]] == [1.0, 2.0, 3.0]


def test_a_configured_tracker_without_its_package_is_a_clear_error(monkeypatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "wandb" else real(name))
    with pytest.raises(ValueError, match=r"logging.wandb is set but the wandb package is missing.*molt-hpc\[wandb\]"):
        check_trackers(BOTH)


@pytest.mark.slow
def test_a_local_run_and_its_resume_log_one_wandb_run(tmp_path: Path, tiny_model_dir: Path) -> None:
    overrides = [
        "--set", f"model.path={tiny_model_dir}", "--set", f"run.root={tmp_path}", "--set", "run.name=tracked",
        "--set", "run.steps=3", "--set", "checkpoint.interval=3", "--set", "logging.wandb.mode=offline",
        "--set", "logging.tensorboard.dir=" + str(tmp_path / "tb"), "--set", "logging.progress=lines",
    ]  # fmt: skip
    assert molt("run", "configs/tiny_cpu.toml", *overrides, timeout=600).returncode == 0
    more = ["--set", "run.steps=5", "--set", "logging.progress=lines"]
    assert molt("run", "--resume", str(tmp_path / "tracked"), *more, timeout=600).returncode == 0
    ids, rows = wandb_history(tmp_path / "tracked")
    assert len(ids) == 1
    assert sorted(r["actor/step"] for r in rows if "actor/step" in r) == [1, 2, 3, 4, 5]
    assert [s for s, _ in tensorboard_scalars(tmp_path / "tb")["actor/reward"]] == [1, 2, 3, 4, 5]
