"""Hostile code in the sandbox: each attack gets a failed result and nothing else. After each one the
same server process answers `/health` with its whole pool, and nothing the code started is left.

Real parts: the sandbox server process (`jobs/engine.py --role sandbox`) with bubblewrap isolation on
loopback, its client over HTTP, a 2 s wall limit and 256 MiB of address space per execution.
"""

import os
import shutil
import signal

import pytest

from molt_hpc.sandbox.execute import KILL_GRACE_S
from tests.sandbox_support import health, run_code, sandbox_run, start_sandbox

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
WORKERS = 2


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    run = sandbox_run(tmp_path_factory.mktemp("hostile"), "sandbox.isolation='bwrap'")
    proc = start_sandbox(run)
    yield run, proc
    proc.stop()


def slot_processes(users: list[int]) -> list[int]:
    """Processes of the worker slots' user ids (a root server runs executions as those)."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid in users:
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def check_unharmed(server, before: int) -> None:
    run, proc = server
    assert proc.proc.poll() is None, "the sandbox server died"
    state = health(run)
    assert state["status"] == "ok" and state["isolation"] == "bwrap"
    assert state["workers"] == WORKERS and state["live_workers"] == WORKERS and state["running"] == 0
    assert state["executions"] == before + 1
    assert run_code(run, "print(sum(range(10)))").stdout == "45\n"  # the pool still works
    if os.geteuid() == 0:  # each slot its own user id, none shared with another server; none of it left
        assert len(set(state["users"])) == WORKERS and slot_processes(state["users"]) == []


def attack(server, code: str, **kw):
    before = health(server[0])["executions"]
    result = run_code(server[0], code, **kw)
    assert not result.ok, result
    check_unharmed(server, before)
    return result


def test_infinite_loop_is_stopped_at_the_wall_limit(server) -> None:
    result = attack(server, "while True:\n    pass\n", timeout=1.0)
    assert result.killed_reason in ("timeout", "cpu")
    assert result.wall_s < 1.0 + KILL_GRACE_S + 1.0  # the limit, the kill, its pipes closing


def test_sleeping_forever_is_a_timeout(server) -> None:
    result = attack(server, "import time\ntime.sleep(60)\n", timeout=1.0)
    assert result.timed_out and result.killed_reason == "timeout"


def test_closing_its_output_and_running_on_is_a_timeout(server) -> None:
    result = attack(server, "import os, time\nos.close(1)\nos.close(2)\ntime.sleep(60)\n", timeout=1.0)
    assert result.timed_out and result.wall_s < 1.0 + KILL_GRACE_S + 1.0


def test_fork_bomb_is_capped_and_its_processes_die(server) -> None:
    code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    result = attack(server, code, timeout=1.0)
    assert result.killed_reason in ("timeout", "cpu")


def test_ten_gigabytes_of_memory_fail(server) -> None:
    result = attack(server, "x = bytearray(10 * 1024**3)\nprint(len(x))\n")
    assert result.killed_reason == "memory" and "MemoryError" in result.stderr and result.stdout == ""


def test_a_gigabyte_of_output_is_cut_and_killed(server) -> None:
    result = attack(server, "import sys\nfor _ in range(1024):\n    sys.stdout.write('x' * (1 << 20))\n")
    assert result.killed_reason == "output"
    assert result.stdout == "x" * 65536  # exactly sandbox.max_output_bytes kept


def test_network_connections_fail(server) -> None:
    run, _ = server
    port = int(run_code_url(run).rsplit(":", 1)[1])
    code = (
        "import socket\n"
        f"for host, port in (('127.0.0.1', {port}), ('1.1.1.1', 53)):\n"
        "    try:\n"
        "        socket.create_connection((host, port), timeout=1).close()\n"
        "        print('connected', host)\n"
        "    except OSError as err:\n"
        "        print('refused', host, type(err).__name__)\n"
        "raise SystemExit(1)\n"
    )
    result = attack(server, code)
    assert "connected" not in result.stdout and result.stdout.count("refused") == 2


def run_code_url(run) -> str:
    from molt_hpc.sandbox.client import SandboxClient

    url = SandboxClient(run.path).url()
    assert url is not None
    return url


def test_writing_outside_its_directory_fails(server) -> None:
    run, _ = server
    targets = ["/usr/evil", "/evil", str(run.path / "evil"), "/proc/sys/kernel/evil"]
    code = (
        "ok = []\n"
        f"for path in {targets!r}:\n"
        "    try:\n"
        "        open(path, 'w').write('x')\n"
        "        ok.append(path)\n"
        "    except OSError:\n"
        "        pass\n"
        "open('inside.txt', 'w').write('fine')\n"
        "print(ok)\n"
        "raise SystemExit(1 if not ok else 0)\n"
    )
    result = attack(server, code)
    assert result.stdout == "[]\n" and result.exit_code == 1
    assert not (run.path / "evil").exists()


def test_the_run_token_and_files_are_out_of_reach(server) -> None:
    run, proc = server
    token = run.token()
    code = (
        "import os\n"
        "seen = []\n"
        f"for path in ({str(run.token_file)!r}, {str(run.config)!r}, '/proc/{proc.proc.pid}/environ', "
        f"'/proc/1/environ'):\n"
        "    try:\n"
        "        seen += [text for text in [open(path).read()] if text]  # the namespace's init has no environment\n"
        "    except OSError as err:\n"
        "        print(type(err).__name__)\n"
        "print(sorted(os.environ))\n"
        "print(seen)\n"
        "raise SystemExit(3)\n"
    )
    result = attack(server, code)
    assert token not in result.stdout + result.stderr
    assert "MOLT" not in result.stdout and "[]" in result.stdout.splitlines()[-1]


def test_killing_its_parent_does_not_reach_it(server) -> None:
    _, proc = server
    code = (
        "import os, signal\n"
        "for sig_target in (os.getppid(), 1):\n"
        "    try:\n"
        "        os.kill(sig_target, signal.SIGKILL)\n"
        "    except OSError:\n"
        "        pass\n"
        f"os.kill({proc.proc.pid}, signal.SIGKILL)\n"
        f"os.killpg({os.getpgid(proc.proc.pid)}, signal.SIGKILL)\n"
    )
    result = attack(server, code)
    assert "ProcessLookupError" in result.stderr or "PermissionError" in result.stderr
    assert signal.SIGKILL  # the server answered check_unharmed above: it was not killed
