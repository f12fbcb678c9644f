"""The vLLM engine process's lifecycle on a CPU: without vLLM it stops with the fix; around a FAKE `vllm
serve` (vLLM needs a GPU) it passes the token, polls until healthy, registers, and unregisters and exits
when vLLM or a signal ends it. The front in front of a real upstream is in `test_vllm_engine.py`.
"""

import importlib.metadata
import json
import os
import signal
from pathlib import Path

import aiohttp
import pytest

from molt_hpc.engine.client import health
from tests.test_engine_procs import arun, make_run, spawn, wait_registered


def test_engine_process_without_vllm_fails_with_the_fix(tmp_path, tiny_model_dir) -> None:
    run = make_run(tmp_path, "novllm", tiny_model_dir, "engines.kind=vllm", "engines.device=cuda")
    proc = spawn(run, "engine", 0)
    assert proc.proc.wait(timeout=60) != 0
    log = proc.log.read_text()
    assert "vLLM is not installed" in log and "molt-hpc[gpu]" in log, log[-2000:]
    assert not (run.rendezvous / "engine-0.json").exists()
    assert not (run.logs / "vllm-0.log").exists(), "vLLM is never started when the check fails"


# A FAKE `vllm serve` (vLLM needs a GPU) for the engine process's lifecycle: it answers /health only
# and writes down what it was started with. Generation through the front is tested above against the
# builtin engine.
FAKE_API_SERVER = """
import json, os, sys, time
from aiohttp import web

args = sys.argv[1:]
with open(os.environ["FAKE_VLLM_RECORD"], "w") as f:
    json.dump({"pid": os.getpid(), "argv": args, "env": {k: os.environ.get(k) for k in
               ("VLLM_API_KEY", "VLLM_SERVER_DEV_MODE", "NCCL_NVLS_ENABLE")}}, f)
if os.environ.get("FAKE_VLLM_MODE") == "crash":
    sys.exit("RuntimeError: CUDA error: no kernel image is available (fake)")
time.sleep(1.0)  # vLLM takes minutes to come up: the engine must poll
app = web.Application()
app.router.add_get("/health", lambda request: web.Response())
web.run_app(app, host="127.0.0.1", port=int(args[args.index("--port") + 1]), print=None)
"""


@pytest.fixture
def fake_vllm(tmp_path) -> dict[str, str]:
    """An installed-looking `vllm` 0.26.0 (a package and its metadata, pinning this torch) that is FAKE."""
    root = tmp_path / "site"
    pkg = root / "vllm" / "entrypoints" / "openai"
    pkg.mkdir(parents=True)
    for d in (root / "vllm", root / "vllm" / "entrypoints", pkg):
        (d / "__init__.py").write_text("")
    (pkg / "api_server.py").write_text(FAKE_API_SERVER)
    info = root / "vllm-0.26.0.dist-info"
    info.mkdir()
    torch_pin = importlib.metadata.version("torch").split("+")[0]
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: 0.26.0\nRequires-Dist: torch=={torch_pin}\n"
    )
    return {"PYTHONPATH": str(root), "FAKE_VLLM_RECORD": str(tmp_path / "fake-vllm.json")}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_engine_process_lifecycle_around_vllm(tmp_path, tiny_model_dir, fake_vllm) -> None:
    """Start: vLLM gets the token in its environment and is polled until healthy, then the front registers.
    SIGTERM: unregister, stop vLLM, exit 0. vLLM dying while serving: unregister, exit 1."""
    run = make_run(tmp_path, "life", tiny_model_dir, "engines.kind=vllm", "engines.device=cuda")
    engine = wait_registered(run, spawn(run, "engine", 0, env=fake_vllm), "engine-0", timeout=60)
    started = json.loads(Path(fake_vllm["FAKE_VLLM_RECORD"]).read_text())
    assert started["env"] == {"VLLM_API_KEY": run.token(), "VLLM_SERVER_DEV_MODE": "1", "NCCL_NVLS_ENABLE": "0"}
    assert run.token() not in " ".join(started["argv"]) and started["argv"][:2] == ["--model", str(tiny_model_dir)]
    assert json.loads((run.rendezvous / "engine-0.json").read_text())["kind"] == "vllm"

    async def front_health():
        async with aiohttp.ClientSession() as s:
            return await health(s, engine.url, token=run.token())

    assert arun(front_health()) == {"status": "ok", "index": 0, "kind": "vllm", "weight_version": 0}
    assert engine.stop(signal.SIGTERM) == 0
    assert not (run.rendezvous / "engine-0.json").exists() and not alive(started["pid"])

    engine = wait_registered(run, spawn(run, "engine", 0, env=fake_vllm), "engine-0", timeout=60)
    os.kill(json.loads(Path(fake_vllm["FAKE_VLLM_RECORD"]).read_text())["pid"], signal.SIGKILL)
    assert engine.proc.wait(timeout=30) == 1
    assert "vLLM exited with -9 while serving" in engine.log.read_text()
    assert not (run.rendezvous / "engine-0.json").exists()


def test_vllm_dying_at_startup_shows_its_log(tmp_path, tiny_model_dir, fake_vllm) -> None:
    run = make_run(tmp_path, "crash", tiny_model_dir, "engines.kind=vllm", "engines.device=cuda")
    proc = spawn(run, "engine", 0, env={**fake_vllm, "FAKE_VLLM_MODE": "crash"})
    assert proc.proc.wait(timeout=60) != 0
    log = proc.log.read_text()
    assert "vLLM exited with 1 before it was ready" in log and "no kernel image is available (fake)" in log, log
    assert (run.logs / "vllm-0.log").is_file() and not (run.rendezvous / "engine-0.json").exists()
