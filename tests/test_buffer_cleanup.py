"""A finished run's /dev/shm spool is removed, a stopped one's kept; `molt-hpc buffer clean` removes
it by hand and refuses while a process of the run is alive."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from molt_hpc.buffer import find_spool, open_buffer
from molt_hpc.buffer.cleanup import release_finished
from molt_hpc.config import load_config, to_toml
from molt_hpc.rundir import create_run_dir
from tests.conftest import molt
from tests.test_buffer import make_group


def shm_run(tmp_path: Path, name: str):
    cfg = load_config(None, [f'run.root="{tmp_path}"', f'run.name="{name}"', 'buffer.backend="shm"'])
    run = create_run_dir(tmp_path, name, to_toml(cfg))
    buf = open_buffer(cfg.buffer, run.path, producer_id="rollout")
    buf.put(make_group("g0"))
    spool = find_spool(run.path)
    assert spool.is_dir() and str(spool).startswith("/dev/shm/")
    return run, spool


def record_processes(run, **pids: int) -> None:
    (run.path / "processes.json").write_text(json.dumps(pids))


def exited_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_finished_run_frees_its_spool_and_a_stopped_one_keeps_it(tmp_path: Path) -> None:
    finished, finished_spool = shm_run(tmp_path, "finished")
    stopped, stopped_spool = shm_run(tmp_path, "stopped")
    (finished.path / "control").mkdir(exist_ok=True)
    (finished.path / "control" / "done").touch()
    assert release_finished(finished.path) == finished_spool
    assert not finished_spool.exists()
    with pytest.raises(ValueError, match="was removed"):
        find_spool(finished.path)
    assert release_finished(stopped.path) is None  # no control/done: a resume starts from this spool
    assert stopped_spool.is_dir() and find_spool(stopped.path) == stopped_spool
    by_hand = molt("buffer", "clean", str(stopped.path))
    assert by_hand.returncode == 0 and "removed" in by_hand.stdout
    assert not stopped_spool.exists()


def test_buffer_clean_refuses_while_the_run_is_live(tmp_path: Path) -> None:
    run, spool = shm_run(tmp_path, "live")
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        record_processes(run, **{"actor pool": exited_pid(), "engine pool": sleeper.pid})
        out = molt("buffer", "clean", str(run.path))
        assert out.returncode == 2 and "is live" in out.stderr and f"pid {sleeper.pid}" in out.stderr
        assert spool.is_dir()
    finally:
        sleeper.kill()
        sleeper.wait()
    out = molt("buffer", "clean", str(run.path))
    assert out.returncode == 0 and out.stdout.strip() == f"removed {spool}"
    assert not spool.exists()
    again = molt("buffer", "clean", str(run.path))
    assert again.returncode == 0 and "nothing to remove" in again.stdout and str(spool) in again.stdout
    stats = molt("buffer", "stats", str(run.path))
    assert stats.returncode == 2 and "was removed" in stats.stderr


def test_buffer_clean_leaves_an_fs_spool_alone(tmp_path: Path) -> None:
    cfg = load_config(None, [f'run.root="{tmp_path}"', 'run.name="fs"'])
    run = create_run_dir(tmp_path, "fs", to_toml(cfg))
    open_buffer(cfg.buffer, run.path, producer_id="rollout").put(make_group("g0"))
    out = molt("buffer", "clean", str(run.path))
    assert out.returncode == 0 and "buffer.backend = 'fs'" in out.stdout
    assert find_spool(run.path) == run.path / "buffer"
