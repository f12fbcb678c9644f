"""Helpers (no tests) for the rollout tests: a real engine pool (engines + router) and run directories.

The pool runs `jobs/engine.py` processes exactly as the launcher does, and is started once per
test session (`shared_pool`) because engine start-up dominates the tests' time. Orchestrators
under test get their own run directory (own buffer, state, metrics) that shares the pool's token
and rendezvous files.
"""

import atexit
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from molt_hpc.config import MoltConfig, load_config, to_toml
from molt_hpc.rundir import RunDir, create_run_dir

ROOT = Path(__file__).resolve().parents[1]


def base_overrides(model_dir: Path) -> list[str]:
    """A small, fast rollout setup on the prebuilt tiny model with one torch thread per process."""
    return [
        f"model.path={json.dumps(str(model_dir))}",
        "engines.threads=1",
        "engines.max_batch=32",
        f"data.path={json.dumps(str(ROOT / 'data' / 'reverse_train.jsonl'))}",
        f"rollout.agent={json.dumps(str(ROOT / 'envs' / 'reverse.py'))}",
        "rollout.n_samples=2",
        "rollout.max_new_tokens=8",
        "rollout.groups_in_flight=4",
        "actor.groups_per_step=4",
        "actor.mini_batches=1",
        "algorithm.dynamic_sampling=false",
        "buffer.capacity=64",
        "router.health_interval_s=0.5",
    ]


def make_run(root: Path, name: str, overrides: list[str], share: RunDir | None = None) -> tuple[RunDir, MoltConfig]:
    """A run directory with the resolved config; with `share`, it reuses that run's token and rendezvous."""
    cfg = load_config(None, overrides)
    if share is not None:
        shutil.copytree(share.rendezvous, root / name / "rendezvous")
    return create_run_dir(root, name, to_toml(cfg)), cfg


@dataclass
class Proc:
    proc: subprocess.Popen
    log: Path

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def stop(self, timeout: float = 20) -> int:
        self.signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:] if self.log.exists() else "(no log)"


def spawn(script: str, args: list[str], log: Path) -> Proc:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, str(ROOT / "jobs" / script), *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            cwd=ROOT,
        )
    return Proc(proc, log)


def wait_file(path: Path, procs: list[Proc], timeout: float = 120, pid: int | None = None) -> dict:
    """The JSON in `path` once it exists (and names `pid`, if given); fails early if a process dies."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            if p.proc.poll() is not None:
                raise RuntimeError(f"{p.log.name} exited with {p.proc.returncode}:\n{p.tail()}")
        try:
            record = json.loads(path.read_text())
            if pid is None or record.get("pid") == pid:
                return record
        except (FileNotFoundError, json.JSONDecodeError):
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{path} did not appear within {timeout} s")


@dataclass
class Pool:
    """Engines and a router serving one run directory."""

    run: RunDir
    cfg: MoltConfig
    engines: list[Proc] = field(default_factory=list)
    router: Proc | None = None

    def engine_url(self, index: int) -> str:
        return json.loads((self.run.rendezvous / f"engine-{index}.json").read_text())["url"]

    def start_engine(self, index: int) -> Proc:
        return spawn("engine.py", [str(self.run.path), "--role", "engine", "--index", str(index)],
                     self.run.logs / f"engine-{index}.log")  # fmt: skip

    def stop(self) -> None:
        for p in [*self.engines, *([self.router] if self.router else [])]:
            p.stop()


def start_pool(root: Path, overrides: list[str], n_engines: int) -> Pool:
    run, cfg = make_run(root, "pool", overrides)
    pool = Pool(run, cfg)
    pool.engines = [pool.start_engine(i) for i in range(n_engines)]
    pool.router = spawn("engine.py", [str(run.path), "--role", "router"], run.logs / "router.log")
    try:
        for i, p in enumerate(pool.engines):
            wait_file(run.rendezvous / f"engine-{i}.json", [p], pid=p.proc.pid)
        wait_file(run.rendezvous / "router.json", [pool.router])
        wait_router_sees(pool, n_engines)
    except BaseException:
        pool.stop()
        raise
    return pool


def router_metrics(pool: Pool) -> dict:
    """The router's `/metrics`: per-engine health and in-flight counts."""
    url = json.loads((pool.run.rendezvous / "router.json").read_text())["url"] + "/metrics"
    with urllib.request.urlopen(urllib.request.Request(url, headers=pool.run.auth_headers()), timeout=5) as resp:
        return json.loads(resp.read())


def wait_router_sees(pool: Pool, n_engines: int, timeout: float = 30) -> None:
    """Block until the router has `n_engines` healthy engines."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if router_metrics(pool)["healthy"] >= n_engines:
                return
        except OSError:  # the router is still starting
            pass
        time.sleep(0.2)
    raise TimeoutError(f"the router did not see {n_engines} healthy engines within {timeout} s")


_SHARED: dict[str, Pool] = {}


def shared_pool(root: Path, model_dir: Path) -> Pool:
    """One pool (2 engines + router) for every rollout test module of the session, stopped at exit."""
    if "pool" not in _SHARED:
        pool = start_pool(root, base_overrides(model_dir), n_engines=2)
        atexit.register(pool.stop)
        _SHARED["pool"] = pool
    return _SHARED["pool"]
