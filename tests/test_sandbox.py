"""The sandbox server and its client: the token, typed bodies, files and stdin, the bounded queue (429),
a client that follows a restarted server, `state.sandbox`, the rlimit fallback and `auto`'s choice.

Real parts: sandbox server processes (`jobs/engine.py --role sandbox`) and an in-process server on a
loopback socket, bubblewrap, aiohttp, real `python3` executions.
"""

import asyncio
import json
import logging
import os
import shutil
import signal
import socket
import tempfile
from pathlib import Path

import aiohttp
import pytest

from molt_hpc.agents import State
from molt_hpc.config.sandbox import SandboxConfig
from molt_hpc.sandbox import isolation
from molt_hpc.sandbox.client import RUN_DIR_ENV, SandboxClient, SandboxUnavailable
from molt_hpc.sandbox.execute import execute
from molt_hpc.sandbox.protocol import RunRequest
from molt_hpc.sandbox.server import Pool, build_app
from tests.conftest import BIN, molt
from tests.sandbox_support import health, run_code, sandbox_run, start_sandbox

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    run = sandbox_run(tmp_path_factory.mktemp("sandbox"))
    proc = start_sandbox(run)
    yield run, proc
    proc.stop()


async def post(url: str, body, token: str | None) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    async with aiohttp.ClientSession() as s, s.post(url + "/run", json=body, headers=headers) as r:
        return r.status, await r.json()


@needs_bwrap
def test_every_route_needs_the_token_and_bodies_are_checked(server) -> None:
    run, proc = server
    assert asyncio.run(post(proc.url, {"code": "print(1)"}, None))[0] == 401
    assert asyncio.run(post(proc.url, {"code": "print(1)"}, "wrong"))[0] == 401
    status, body = asyncio.run(post(proc.url, {"code": "print(1)", "shell": True}, run.token()))
    assert status == 400 and "shell" in body["error"]
    status, body = asyncio.run(post(proc.url, {"code": "1", "files": {"../escape": "x"}}, run.token()))
    assert status == 400 and "../escape" in body["error"]
    assert health(run)["isolation"] == "bwrap"


@needs_bwrap
def test_stdin_and_files_reach_the_code_in_its_working_directory(server) -> None:
    run, _ = server
    code = "import os\nprint(input().upper(), os.getcwd(), open('data/in.txt').read(), sorted(os.listdir('.')))"
    result = run_code(run, code, stdin="hello\n", files={"data/in.txt": "payload", "top.txt": ""})
    assert result.ok and result.stdout == "HELLO /work payload ['data', 'top.txt']\n"
    crashed = run_code(run, "raise SystemExit(7)")
    assert crashed.exit_code == 7 and not crashed.ok and crashed.killed_reason is None


def test_a_full_queue_answers_429_and_the_client_waits_its_turn(tmp_path) -> None:
    run = sandbox_run(tmp_path)
    cfg = SandboxConfig(isolation="rlimit", workers=1, max_queue=1, timeout_s=5)

    async def go():
        pool = Pool(cfg, "rlimit")
        from aiohttp import web

        runner = web.AppRunner(build_app(pool, run.token()))
        await runner.setup()
        sock = socket.create_server(("127.0.0.1", 0))
        await web.SockSite(runner, sock).start()
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        (run.rendezvous / "sandbox.json").write_text(json.dumps({"url": url}))
        release = Path(shared) / "release"  # where the code's unprivileged user can see it
        slow = {"code": f"import os, time\nwhile not os.path.exists({str(release)!r}):\n    time.sleep(0.01)"}
        first = asyncio.create_task(post(url, slow, run.token()))
        while pool.running < 1:
            await asyncio.sleep(0.01)
        second = asyncio.create_task(post(url, slow, run.token()))
        while pool.waiting < 1:
            await asyncio.sleep(0.01)
        assert (await post(url, slow, run.token()))[0] == 429  # one running, one waiting: full
        client = SandboxClient(run.path, wait_s=30)
        fourth = asyncio.create_task(client.run("print('after')"))  # retried until there is room
        release.touch()
        answers = [await first, await second]
        assert [status for status, _ in answers] == [200, 200]
        assert [body["exit_code"] for _, body in answers] == [0, 0]  # released, not timed out
        assert (await fourth).stdout == "after\n"
        assert pool.health()["live_workers"] == 1 and pool.executions == 3
        await client.close()
        await runner.cleanup()

    with tempfile.TemporaryDirectory() as shared:
        os.chmod(shared, 0o755)
        asyncio.run(go())


def test_state_sandbox_needs_the_section(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv(RUN_DIR_ENV, raising=False)
    with pytest.raises(ValueError, match=r"\[sandbox\]"):
        _ = State(prompt="p", label=None).sandbox
    monkeypatch.setenv(RUN_DIR_ENV, str(tmp_path))
    assert State(prompt="p", label=None).sandbox.rundir.path == tmp_path


def test_rlimit_mode_keeps_the_limits(tmp_path) -> None:
    cfg = SandboxConfig(isolation="rlimit", timeout_s=1, memory_mb=256, max_output_bytes=1000)

    (user,) = isolation.claim_users(1)

    def run(code: str):
        return asyncio.run(execute(cfg, "rlimit", RunRequest(code=code, files={"a.txt": "A"}), user))

    ok = run("import os\nprint(open('a.txt').read(), sorted(os.environ))")
    names = set(json.loads(ok.stdout.split(" ", 1)[1].replace("'", '"'))) - {"LC_CTYPE"}  # LC_CTYPE: Python's own
    assert ok.ok and ok.stdout.startswith("A ") and names == {"HOME", "PATH", "PYTHONDONTWRITEBYTECODE", "TMPDIR"}
    assert run("x = bytearray(1 << 30)").killed_reason == "memory"
    assert run("while True:\n    pass").killed_reason in ("timeout", "cpu")
    assert run("print('y' * 5000)").killed_reason == "output"
    assert run("import os, time\nos.close(1)\nos.close(2)\ntime.sleep(60)").timed_out  # still under the clock


def test_auto_falls_back_loudly_and_bwrap_refuses_without_bubblewrap(monkeypatch, caplog) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    with caplog.at_level(logging.WARNING):
        assert isolation.choose(SandboxConfig(isolation="auto")) == "rlimit"
    assert "SANDBOX FALLBACK" in caplog.text
    with pytest.raises(ValueError, match="bubblewrap"):
        isolation.choose(SandboxConfig(isolation="bwrap"))
    with pytest.raises(ValueError, match=r"sandbox\.python"):
        isolation.choose(SandboxConfig(python="/nonexistent/python3"))


def test_slurm_renders_the_sandbox_as_a_cpu_het_group(tmp_path) -> None:
    script = molt("submit", "configs/tiny_code_cpu.toml", "--dry-run", "--no-plan").stdout
    frame, group2 = script.split("# het group 2: sandbox server\n")
    assert frame.count("#SBATCH hetjob") == 2 and "--gpus-per-node" not in group2.split("\n\n")[0]
    for bad, what in (("slurm.sandboxes.nodes=2", "2 nodes"), ("slurm.sandboxes.gpus_per_node=1", "1 GPUs")):
        done = molt("sbatch", "configs/tiny_code_cpu.toml", "--set", bad, "-o", str(tmp_path / "job.sbatch"))
        assert done.returncode == 2 and what in done.stderr and "slurm.sandboxes.nodes = 1" in done.stderr
    assert not (tmp_path / "job.sbatch").exists()
    plain = molt("submit", "configs/tiny_cpu.toml", "--dry-run", "--no-plan").stdout
    assert plain.count("#SBATCH hetjob") == 1 and "het group 2" not in plain.split("\n\n", 1)[1]


def test_run_refuses_a_sandbox_that_cannot_start_before_anything_starts(tmp_path) -> None:
    base = ("run", "configs/tiny_code_cpu.toml", "--set", f"run.root={tmp_path}", "--set", "logging.progress=lines")
    no_bwrap = {"PATH": f"{BIN}:/nonexistent"}
    done = molt(*base, "--set", "sandbox.isolation='bwrap'", env=no_bwrap)
    assert done.returncode == 2 and "sandbox.isolation = 'bwrap' but bwrap is not installed" in done.stderr
    done = molt(*base, "--set", "sandbox.python='/nonexistent/python3'")
    assert done.returncode == 2 and "sandbox.python" in done.stderr
    assert not (tmp_path / "tiny-code-cpu").exists()


def test_the_engine_pool_runs_the_sandbox_without_gpus_and_tells_the_orchestrator(tmp_path) -> None:
    from molt_hpc.config import load_config
    from molt_hpc.launch.pool import pool_children

    with_box = sandbox_run(tmp_path / "with")
    engines, services = pool_children(load_config(with_box.config), with_box, 0)
    box = next(c for c in engines if c.name == "sandbox")  # restarted like an engine when it dies
    assert box.cmd[-2:] == ["--role", "sandbox"] and box.env["CUDA_VISIBLE_DEVICES"] == ""
    orchestrator = next(c for c in services if c.name == "orchestrator")
    assert orchestrator.env[RUN_DIR_ENV] == str(with_box.path)
    node1 = pool_children(load_config(with_box.config), with_box, 1)[0]
    assert [c.name for c in node1] == ["engine 1"]  # only the pool's first node runs the sandbox
    plain = load_config(None, [])
    engines, services = pool_children(plain, with_box, 0)
    assert "sandbox" not in [c.name for c in engines] and all(RUN_DIR_ENV not in c.env for c in services)


@needs_bwrap
def test_the_pool_restarts_a_dead_sandbox_and_clients_follow_it(tmp_path) -> None:
    from molt_hpc.config import load_config
    from molt_hpc.launch.pool import pool_children, restart
    from tests.test_engine_procs import wait_registered

    run = sandbox_run(tmp_path)
    box = next(c for c in pool_children(load_config(run.config), run, 0)[0] if c.name == "sandbox")
    try:
        first = wait_registered(run, box.start(), "sandbox", timeout=60).proc.pid
        assert run_code(run, "print('before')").stdout == "before\n"
        box.signal(signal.SIGKILL)
        assert restart(box, box.proc.wait(), max_restarts=2, run=run) and box.restarts == 1
        assert wait_registered(run, box, "sandbox", timeout=60).proc.pid != first
        assert run_code(run, "print('after')").stdout == "after\n" and health(run)["executions"] == 1
        assert SandboxClient(run.path).run_sync("print(input())", stdin="sync").stdout == "sync\n"
    finally:
        box.stop()
    assert box.proc.returncode == 0 and not (run.rendezvous / "sandbox.json").exists()  # unregistered
    with pytest.raises(SandboxUnavailable):
        SandboxClient(run.path, wait_s=0.2).run_sync("print(1)")
