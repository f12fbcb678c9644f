"""A two-rank trainer exits 0 every time: its shutdown is ordered (barrier, process groups destroyed)
and it leaves before the interpreter's teardown, which torch's gloo threads (alive past
`destroy_process_group` once FSDP2 used the group) could turn into a SIGABRT.

Each rank is started as torchrun starts it (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; rank 0 hosts
the store), without torchrun's own agent process, to keep 20 launches lean.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from molt_hpc.net import free_port
from tests.conftest import ROOT

pytestmark = pytest.mark.slow

ENTRY = ROOT / "tests" / "actor_exit_entry.py"


def two_ranks(log_dir: Path, attempt: int) -> list[tuple[int, str]]:
    port = free_port("127.0.0.1")
    procs = []
    for rank in range(2):
        env = {
            **os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
        }  # fmt: skip
        log = open(log_dir / f"run{attempt}-rank{rank}.log", "w")  # noqa: SIM115 - closed below
        procs.append((subprocess.Popen([sys.executable, str(ENTRY)], cwd=ROOT, env=env, stdout=log,
                                       stderr=subprocess.STDOUT), log))  # fmt: skip
    out = []
    for proc, log in procs:
        try:
            code = proc.wait(timeout=180)
        finally:
            if proc.poll() is None:
                proc.kill()
            log.close()
        out.append((code, Path(log.name).read_text()))
    return out


def test_a_two_rank_trainer_exits_0_twenty_times(tmp_path: Path) -> None:
    for attempt in range(20):
        for rank, (code, log) in enumerate(two_ranks(tmp_path, attempt)):
            assert code == 0, f"run {attempt}, rank {rank} exited {code}:\n{log[-3000:]}"
