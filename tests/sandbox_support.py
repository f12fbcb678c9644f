"""A real sandbox server process for tests: a run directory with a `[sandbox]` section and the process
started by `jobs/engine.py RUN_DIR --role sandbox`, as the engine pool starts it."""

import asyncio
from pathlib import Path

from molt_hpc.config import load_config, to_toml
from molt_hpc.rundir import RunDir, create_run_dir
from molt_hpc.sandbox.client import SandboxClient
from tests.test_engine_procs import Proc, spawn, wait_registered

LIMITS = ("sandbox.timeout_s=2", "sandbox.workers=2", "sandbox.memory_mb=256", "sandbox.max_output_bytes=65536")


def sandbox_run(root: Path, *overrides: str) -> RunDir:
    cfg = load_config(None, [*LIMITS, *overrides])
    return create_run_dir(root, "sandboxed", to_toml(cfg))


def start_sandbox(run: RunDir) -> Proc:
    return wait_registered(run, spawn(run, "sandbox"), "sandbox", timeout=60)


def health(run: RunDir) -> dict:
    async def go():
        client = SandboxClient(run.path)
        try:
            return await client.health()
        finally:
            await client.close()

    return asyncio.run(go())


def run_code(run: RunDir, code: str, **kw):
    async def go():
        client = SandboxClient(run.path, wait_s=30)
        try:
            return await client.run(code, **kw)
        finally:
            await client.close()

    return asyncio.run(go())
