"""Helpers (no tests) that start real engine and router processes on loopback for the engine-pool tests."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from molt_hpc.config import load_config, to_toml
from molt_hpc.rundir import RunDir, create_run_dir

ROOT = Path(__file__).resolve().parents[1]


def make_run(root: Path, name: str, model_dir: Path, *overrides: str) -> RunDir:
    """A run directory whose config points at the prebuilt tiny model, one torch thread per process."""
    cfg = load_config(None, [f"model.path={json.dumps(str(model_dir))}", "engines.threads=1", *overrides])
    return create_run_dir(root, name, to_toml(cfg))


@dataclass
class Proc:
    """A started engine-pool process and the URL it registered."""

    proc: subprocess.Popen
    log: Path
    url: str = ""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


def spawn(run: RunDir, role: str, index: int = 0, env: dict[str, str] | None = None) -> Proc:
    log = run.logs / (f"{role}-{index}.log" if role == "engine" else f"{role}.log")
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, str(ROOT / "jobs" / "engine.py"), str(run.path), "--role", role, "--index", str(index)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        )
    return Proc(proc, log)


def wait_registered(run: RunDir, p: Proc, name: str, timeout: float = 90) -> Proc:
    """Wait until `rendezvous/<name>.json` names this process; fail with its log if it dies first."""
    path = run.rendezvous / f"{name}.json"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if p.proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {p.proc.returncode}:\n{p.log.read_text()[-3000:]}")
        try:
            record = json.loads(path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            record = {}
        if record.get("pid") == p.proc.pid:
            p.url = record["url"]
            return p
        time.sleep(0.1)
    raise TimeoutError(f"{name} did not register within {timeout}s:\n{p.log.read_text()[-3000:]}")


def start_engines(run: RunDir, indices: list[int]) -> list[Proc]:
    """Start engines in parallel (their imports overlap) and wait for each to register."""
    procs = [spawn(run, "engine", i) for i in indices]
    return [wait_registered(run, p, f"engine-{i}") for p, i in zip(procs, indices, strict=True)]


def headers(run: RunDir) -> dict[str, str]:
    return run.auth_headers()


def arun(coro):
    return asyncio.run(coro)


async def get_json(url: str, run: RunDir) -> dict:
    async with aiohttp.ClientSession() as s, s.get(url, headers=headers(run)) as r:
        assert r.status == 200, await r.text()
        return await r.json()
