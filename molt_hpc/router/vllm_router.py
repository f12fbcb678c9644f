"""`router.kind = "vllm-router"`: vLLM's Rust router in front of the engines, started and watched by us.

The router process of the engine pool becomes a small supervisor of a `vllm-router` child:
consistent hashing on `X-Session-ID` (the header our clients send), the engines of
`rendezvous/engine-*.json` as its workers. vLLM's router checks `GET /health` without credentials,
so with this router kind the engines answer a tokenless `/health` with `{"status": "ok"}` and
nothing more. Requests pass the caller's `Authorization` header on, so every request that reaches
an engine still needs the run's token.

vLLM's router answers its own admin routes (`/add_worker`, `/list_workers`) without a token; the
supervisor compares its workers with this run's engines every health interval and stops if a
foreign one appears, since requests (and the token they carry) would go there. An engine that
restarts on a new port restarts the child on the same port with the new worker list; the
registration in `rendezvous/router.json` names this supervisor's pid and the child's address. A new
engine (a restart, an extra pool) becomes a worker only once it serves the newest weight version any
engine serves, as in the built-in router: no request meets stale weights. Engines already routed to stay
through a refit, which updates them one after another.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from molt_hpc.config import MoltConfig
from molt_hpc.log import get_logger, setup_logging
from molt_hpc.net import ALL_INTERFACES, free_port
from molt_hpc.router.pool import ENGINE_FILE, admits
from molt_hpc.rundir import RunDir, atomic_write

INSTALL = "pip install 'molt-hpc[vllm-router]'"
START_TIMEOUT_S = 120.0


def router_binary() -> str:
    """The `vllm-router` command of this environment, or a clear error naming the install."""
    here = Path(sys.executable).parent / "vllm-router"
    found = str(here) if here.is_file() else shutil.which("vllm-router")
    if found is None:
        raise ValueError(f"router.kind = 'vllm-router' needs vLLM's router; install it: {INSTALL}")
    return found


def engine_urls(run: RunDir) -> list[str]:
    """The URLs this run's engines registered, in index order."""
    urls = {}
    for path in run.rendezvous.glob("engine-*.json"):
        match = ENGINE_FILE.match(path.name)
        try:
            url = json.loads(path.read_text())["url"] if match else None
        except (OSError, ValueError, KeyError):  # being replaced: the next scan reads it
            continue
        if match and url:
            urls[int(match.group(1))] = url
    return [urls[i] for i in sorted(urls)]


def served_versions(urls: list[str], token: str) -> dict[str, int | None]:
    """The weight version of each engine that answers its `/health` (asked with the run's token, which gets
    the whole answer): None for one that answers without saying; one that does not answer is left out."""
    out: dict[str, int | None] = {}
    for url in urls:
        req = urllib.request.Request(url + "/health", headers={"Authorization": f"Bearer {token}"})
        try:
            with urllib.request.urlopen(req, timeout=2) as resp:
                version = json.loads(resp.read()).get("weight_version")
        except (OSError, ValueError, AttributeError):  # not answering (or refusing the token): not yet
            continue
        out[url] = version if isinstance(version, int) else None
    return out


def admitted(urls: list[str], current: list[str], versions: dict[str, int | None]) -> list[str]:
    """The workers vLLM's router gets: the engines it routes to now, and each new one that answered and
    serves the newest version any engine serves."""
    newest = max((v for v in versions.values() if v is not None), default=None)
    return [u for u in urls if u in current or (u in versions and admits(versions[u], newest))]


def command(cfg: MoltConfig, port: int, urls: list[str], metrics_port: int) -> list[str]:
    """The `vllm-router` command line (no secret on it: its health checks need none). Its Prometheus exporter
    cannot be turned off and defaults to port 29000 for every router, so two on one machine (two runs, or
    tests in parallel) collided there and the second died: each gets its own free loopback port."""
    return [
        router_binary(),
        "--host", cfg.engines.host,
        "--port", str(port),
        "--prometheus-host", "127.0.0.1",
        "--prometheus-port", str(metrics_port),
        "--worker-urls", *urls,
        "--policy", "consistent_hash",
        "--health-check-endpoint", "/health",
        "--health-check-interval-secs", str(max(1, round(cfg.router.health_interval_s))),
        "--worker-startup-check-interval", "1",
        "--request-timeout-secs", str(int(cfg.rollout.request_timeout_s)),
        "--log-level", "warning",
    ]  # fmt: skip


class Supervisor:
    """Keeps one `vllm-router` child serving this run's current engines on one port."""

    def __init__(self, cfg: MoltConfig, run: RunDir):
        self.cfg, self.run, self.token = cfg, run, run.token()
        self.port = free_port(cfg.engines.host)
        self.metrics_port = free_port("127.0.0.1")
        self.urls: list[str] = []
        self.child: subprocess.Popen | None = None
        host = cfg.engines.host if cfg.engines.host not in ALL_INTERFACES else "127.0.0.1"
        self.url = f"http://{host}:{self.port}"

    def start(self, urls: list[str]) -> None:
        self.stop()
        self.urls = urls
        log = open(self.run.logs / "vllm-router.log", "ab")  # noqa: SIM115 - the child owns it
        self.child = subprocess.Popen(command(self.cfg, self.port, urls, self.metrics_port), stdout=log, stderr=log)
        deadline = time.monotonic() + START_TIMEOUT_S
        while self._get("/health") != 200:  # it answers once a worker passed its health check
            if self.child.poll() is not None:
                raise RuntimeError(f"vllm-router exited with code {self.child.returncode}; see {log.name}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"vllm-router did not become healthy within {START_TIMEOUT_S:.0f} s; see {log.name}")
            time.sleep(0.2)
        get_logger().info("vllm-router at %s routes to %s", self.url, ", ".join(urls))

    def admit(self, urls: list[str]) -> list[str]:
        """Of the registered engines, the ones to route to (`admitted`)."""
        return admitted(urls, self.urls, served_versions(urls, self.token)) if urls else []

    def foreign_workers(self) -> list[str]:
        """Workers the router has that are not this run's engines (someone used its admin routes)."""
        try:
            with urllib.request.urlopen(self.url + "/list_workers", timeout=5) as resp:
                listed = json.loads(resp.read()).get("urls", [])
        except (OSError, ValueError):
            return []
        return [u for u in listed if u not in self.urls]

    def stop(self) -> None:
        if self.child is not None and self.child.poll() is None:
            self.child.terminate()
            try:
                self.child.wait(10)
            except subprocess.TimeoutExpired:
                self.child.kill()
                self.child.wait()
        self.child = None

    def _get(self, path: str) -> int | None:
        try:
            with urllib.request.urlopen(self.url + path, timeout=2) as resp:
                return resp.status
        except urllib.error.HTTPError as err:
            return err.code
        except OSError:
            return None


def main(cfg: MoltConfig, run_dir: str | Path) -> int:
    """Run vLLM's router for the run in `run_dir` until SIGTERM."""
    setup_logging("router", cfg.logging.level)
    log = get_logger()
    run = RunDir(Path(run_dir))
    stopping = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.append(True))
    sup = Supervisor(cfg, run)
    record = run.rendezvous / "router.json"
    try:
        while not (urls := sup.admit(engine_urls(run))) and not stopping:
            time.sleep(0.2)
        if stopping:
            return 0
        sup.start(urls)
        atomic_write(record, json.dumps({"url": sup.url, "pid": os.getpid(), "kind": "vllm-router"}))
        while not stopping:
            time.sleep(cfg.router.health_interval_s)
            if sup.child is None or sup.child.poll() is not None:
                log.error("vllm-router exited with code %s", sup.child.returncode if sup.child else None)
                return 1
            if foreign := sup.foreign_workers():
                log.error("vllm-router has workers that are not engines of this run (%s): stopping", foreign)
                return 1
            if (urls := engine_urls(run)) != sup.urls and (urls := sup.admit(urls)) and urls != sup.urls:
                log.info("engines changed: restarting vllm-router with %s", ", ".join(urls))
                sup.start(urls)
        return 0
    finally:
        if record.exists() and json.loads(record.read_text()).get("pid") == os.getpid():
            record.unlink()
        sup.stop()
