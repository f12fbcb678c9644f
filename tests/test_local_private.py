"""A local run keeps to itself: nothing of it listens beyond loopback, and what it writes is private.

A real tiny run through `molt-hpc run` (launcher, torchrun with the trainer, engine pool, router,
orchestrator). While it trains, every listening TCP socket of its process tree is read from
/proc/net/tcp{,6} (sockets mapped to processes through /proc/<pid>/fd); once it finished, the run
directory is walked: every directory 0700, every file 0600.
"""

import os
import stat
import subprocess
import time
from pathlib import Path

import pytest

from molt_hpc.log import read_metrics
from tests.conftest import BIN, ROOT

pytestmark = pytest.mark.slow
LISTEN = "0A"
LOOPBACK_V4 = "0100007F"  # 127.0.0.1 as /proc/net/tcp writes it (little-endian)
LOOPBACK_V6 = "00000000000000000000000001000000"  # ::1


def tree(root: int) -> set[int]:
    """`root` and every process below it."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(entry.parent.name)] = int(entry.read_text().rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):  # a process that just ended
            continue
    out, grew = {root}, True
    while grew:
        more = {pid for pid, ppid in parents.items() if ppid in out} - out
        out |= more
        grew = bool(more)
    return out


def socket_inodes(pids: set[int]) -> dict[str, int]:
    inodes = {}
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes[target[8:-1]] = pid
        except OSError:  # the process ended meanwhile
            continue
    return inodes


def listeners(pids: set[int]) -> list[tuple[int, str, int]]:
    """(pid, local address as /proc writes it, port) of every listening TCP socket of `pids`."""
    inodes = socket_inodes(pids)
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            addr, port = f[1].split(":")
            if f[3] == LISTEN and f[9] in inodes:
                out.append((inodes[f[9]], addr, int(port, 16)))
    return out


def test_a_local_run_listens_on_loopback_only_and_writes_private_files(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [str(BIN / "molt-hpc"), "run", "configs/tiny_cpu.toml", "--set", f"run.root={tmp_path}",
         "--set", "run.steps=3", "--set", "logging.progress=lines"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    run_dir = tmp_path / "tiny-cpu"
    seen: set[tuple[int, str, int]] = set()
    deadline = time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline:
        seen |= set(listeners(tree(proc.pid)))
        time.sleep(0.2)  # sampling the sockets of a live run, not waiting for an event
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl", source="actor")] == [1, 2, 3]
    assert len({port for _, _, port in seen}) >= 3, f"the engine, router and stores must have been seen: {seen}"
    wide = [(pid, addr, port) for pid, addr, port in seen if addr not in (LOOPBACK_V4, LOOPBACK_V6)]
    names = {
        pid: Path(f"/proc/{pid}/cmdline").read_bytes()[:200] for pid, _, _ in wide if Path(f"/proc/{pid}").exists()
    }
    assert not wide, f"listening beyond loopback: {wide} {names}"

    loose = []
    for path in [run_dir, *run_dir.rglob("*")]:
        mode = stat.S_IMODE(path.lstat().st_mode)
        if path.is_symlink():
            continue
        want = 0o700 if path.is_dir() else 0o600
        if mode != want:
            loose.append(f"{oct(mode)} {path.relative_to(run_dir)}")
    assert not loose, "not private:\n" + "\n".join(loose[:40])
