"""A launcher's children (`molt_hpc.launch.procs`): real subprocesses, waited on and stopped.

`Child.wait` is the launchers' pause between looks (it ends as soon as the child does); `stop_all` signals
every child first and runs `meanwhile` (the end-of-run summary) while they shut down; the actor pool of one
trainer rank is the rank itself, of several ranks torchrun.
"""

import sys
import time
from pathlib import Path

import pytest

from molt_hpc.config import load_config
from molt_hpc.launch.local import actor_child
from molt_hpc.launch.procs import Child, stop_all
from molt_hpc.rundir import create_run_dir

# On SIGTERM: write the file named by argv[1], then exit 0 a moment later (an ordered shutdown).
GRACEFUL = """
import pathlib, signal, sys, time
def stop(*_):
    pathlib.Path(sys.argv[1]).write_text("stopping")
    time.sleep(0.3)
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
pathlib.Path(sys.argv[1] + ".ready").touch()
while True:
    time.sleep(0.05)
"""


def test_wait_returns_the_exit_code_when_the_child_ends_and_none_while_it_runs(tmp_path: Path) -> None:
    child = Child("exits", [sys.executable, "-c", "import time, sys; time.sleep(0.5); sys.exit(3)"], tmp_path / "a.log")
    child.start()
    assert child.wait(0.01) is None  # still running
    t0 = time.monotonic()
    assert child.wait(60) == 3
    assert time.monotonic() - t0 < 30  # it returned with the child, not at its timeout


def test_stop_all_signals_every_child_before_meanwhile_runs(tmp_path: Path) -> None:
    marks = [tmp_path / f"c{i}" for i in range(2)]
    children = [Child(f"c{i}", [sys.executable, "-c", GRACEFUL, str(m)], tmp_path / f"c{i}.log") for i, m in
                enumerate(marks)]  # fmt: skip
    for child in children:
        child.start()
    deadline = time.monotonic() + 60
    while not all(m.with_name(m.name + ".ready").exists() for m in marks):  # their handlers are installed
        assert time.monotonic() < deadline, "the children did not start"
        time.sleep(0.05)
    seen: list[bool] = []

    def meanwhile() -> None:  # every child was asked to stop before this runs; some may still be stopping
        end = time.monotonic() + 30
        while not all(m.exists() for m in marks) and time.monotonic() < end:
            time.sleep(0.01)
        seen.append(all(m.exists() for m in marks))

    assert stop_all(children, grace_s=30, meanwhile=meanwhile) == {"c1": 0, "c0": 0}
    assert seen == [True]


def test_stop_all_waits_for_the_children_when_meanwhile_fails(tmp_path: Path) -> None:
    child = Child("c", [sys.executable, "-c", GRACEFUL, str(tmp_path / "m")], tmp_path / "c.log").start()
    deadline = time.monotonic() + 60
    while not (tmp_path / "m.ready").exists():
        assert time.monotonic() < deadline, "the child did not start"
        time.sleep(0.05)

    def broken() -> None:
        raise RuntimeError("the plot failed")

    with pytest.raises(RuntimeError, match="the plot failed"):  # the failure is not hidden
        stop_all([child], grace_s=30, meanwhile=broken)
    assert child.poll() == 0  # stopped and reaped all the same


def test_one_trainer_rank_runs_without_torchrun_and_more_under_it(tmp_path: Path) -> None:
    run = create_run_dir(tmp_path, "r", "")
    one = actor_child(load_config(None, ["actor.ranks=1"]), run).cmd
    assert one[1].endswith("jobs/actor.py") and "molt_hpc.launch.torchrun" not in one
    two = actor_child(load_config(None, ["actor.ranks=2"]), run).cmd
    assert two[1:3] == ["-m", "molt_hpc.launch.torchrun"] and "--nproc-per-node" in two
    assert two[two.index("--nproc-per-node") + 1] == "2" and two[-2].endswith("jobs/actor.py")
