"""A two-rank trainer exits 0 every time: its shutdown is ordered (barrier, process groups destroyed)
and it leaves before the interpreter's teardown, which torch's gloo threads (alive past
`destroy_process_group` once FSDP2 used the group) could turn into a SIGABRT.

Each rank is set up as torchrun sets one up (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; rank 0 hosts
the store), without torchrun's own agent process, in a child forked from one process that paid the
imports once (`tests/actor_exit_entry.py`), to keep 40 rank lives lean.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow

ENTRY = ROOT / "tests" / "actor_exit_entry.py"
ATTEMPTS = 20


def test_a_two_rank_trainer_exits_0_twenty_times(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, str(ENTRY), str(ATTEMPTS), str(tmp_path)], cwd=ROOT, capture_output=True,
                         text=True, timeout=ATTEMPTS * 200, env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    runs = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [r["attempt"] for r in runs] == list(range(ATTEMPTS)), out.stdout
    for run in runs:
        for rank, code in enumerate(run["codes"]):
            log = (tmp_path / f"run{run['attempt']}-rank{rank}.log").read_text()
            assert code == 0, f"run {run['attempt']}, rank {rank} exited {code}:\n{log[-3000:]}"
