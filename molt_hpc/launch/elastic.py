"""`molt-hpc engines add / list / remove`: extra engine pools join and leave a live run.

Adding checks before anything starts (one line and exit 2 otherwise, the run untouched): the run is
live (its router answers), the run's token is the one its router takes, the pool serves the run's
model and tokenizer, and its engine kind is one the run's trainer refits. The pool's engines then
register like the run's own; the router keeps each out of its ring until it serves the ring's weight
version, which the trainer's refit gives it at once (a change of registrations triggers one: the
trainer's next refit, not a copy from a serving engine; see docs/scavenger.md for why).

Removing drains: the engines' registrations go (the router sends them nothing new, the trainer's
next refit leaves them out), the requests they hold finish (up to `drain_s`), then the pool stops;
what is still in flight then continues on the run's other engines from its tokens.
"""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from molt_hpc.config import MoltConfig, load_config, to_toml
from molt_hpc.launch import pools
from molt_hpc.launch.procs import REPO
from molt_hpc.rundir import RunDir


def open_run(run_dir: str | Path) -> tuple[RunDir, MoltConfig]:
    run = RunDir(Path(run_dir).absolute())
    if not run.config.is_file():
        raise ValueError(f"{run.path} is not a run directory (no config.toml): give the RUN_DIR of a live run")
    return run, load_config(run.config)


def http_json(url: str, token: str, timeout: float = 5.0) -> dict:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def router_url(run: RunDir) -> str | None:
    try:
        return json.loads((run.rendezvous / "router.json").read_text())["url"]
    except (OSError, ValueError, KeyError):
        return None


def check_live(run: RunDir) -> str:
    """The router's URL of a live run; a `ValueError` saying what is wrong otherwise."""
    url = router_url(run)
    if url is None:
        raise ValueError(f"the run at {run.path} is not live (no router registered): start or resume it first")
    try:
        http_json(url + "/health", run.token())
    except urllib.error.HTTPError as err:
        if err.code in (401, 403):
            raise ValueError(
                f"the router of {run.path} refuses the run's token ({run.token_file}): the token file was changed "
                "or copied from another run; restore the run's own token"
            ) from None
        raise ValueError(f"the router of {run.path} answers HTTP {err.code}: is the run live?") from None
    except OSError:
        raise ValueError(f"the run at {run.path} is not live (its router at {url} does not answer): "
                         "start or resume it first") from None  # fmt: skip
    return url


def pool_config(cfg: MoltConfig, count: int | None, kind: str | None, overrides: tuple[str, ...], run: RunDir):
    """The pool's resolved config: the run's, with the pool's count, kind and overrides; refused when its
    model differs from the run's or the run's trainer cannot refit its kind."""
    sets = [*overrides, f"engines.count={count or cfg.engines.count}", f'engines.kind="{kind or cfg.engines.kind}"']
    pool = load_config(run.config, sets)
    if pool.model != cfg.model:
        differ = sorted(k for k in type(cfg.model).model_fields if getattr(pool.model, k) != getattr(cfg.model, k))
        raise ValueError(
            f"the pool's model ({pool.model.path}) differs from the run's ({cfg.model.path}) in {differ}: a pool "
            "serves the run's model and tokenizer; drop the model.* overrides"
        )
    if pool.engines.kind != cfg.engines.kind:
        raise ValueError(
            f"--kind {pool.engines.kind}: the run's trainer refits engines.kind = {cfg.engines.kind!r} engines only "
            f"(its refit sender is chosen at start); add a {cfg.engines.kind!r} pool"
        )
    return pool


def add_local(run_dir: str, count: int | None, kind: str | None, overrides: tuple[str, ...]) -> pools.PoolRecord:
    """Start an extra pool on this machine; returns its record once every engine registered."""
    run, cfg = open_run(run_dir)
    check_live(run)
    pool_cfg = pool_config(cfg, count, kind, overrides, run)
    name, first = pools.next_pool(run)
    record = pools.PoolRecord(name, "local", pool_cfg.engines.kind, list(range(first, first + pool_cfg.engines.count)))
    pools.pools_dir(run).mkdir(mode=0o700, exist_ok=True)
    pools.config_path(run, name).write_text(to_toml(pool_cfg))
    pools.save(run, record)
    cmd = [sys.executable, str(REPO / "jobs" / "engine.py"), str(run.path), "--role", "extra-pool", "--pool", name,
           "--config", str(pools.config_path(run, name))]  # fmt: skip
    with open(run.logs / f"{name}.log", "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, cwd=REPO)  # fmt: skip
    record.pid = proc.pid
    pools.save(run, record)
    wait_registered(run, record, proc, pool_cfg.engines.startup_timeout_s)
    record.state = "serving"
    pools.save(run, record)
    return record


def add_slurm(run_dir: str, count: int | None, kind: str | None, overrides: tuple[str, ...], spec, dry_run: bool):
    """Submit an extra pool as its own Slurm job (`spec`: a `slurm.extra.SlurmPoolSpec`); its record, or the
    batch script with `dry_run` (nothing created)."""
    from molt_hpc.launch.slurm import extra

    run, cfg = open_run(run_dir)
    pool_cfg = pool_config(cfg, count, kind, overrides, run)
    if spec.nodes > 1 and pool_cfg.engines.kind == "builtin":
        raise ValueError("--nodes-per-engine > 1: the builtin engine runs on one node; use --nodes-per-engine 1")
    name, first = pools.next_pool(run)
    if dry_run:
        return extra.dry_run(pool_cfg, run.path, name, spec)
    check_live(run)
    indices = list(range(first, first + pool_cfg.engines.count * spec.nodes))
    record = pools.PoolRecord(name, "slurm", pool_cfg.engines.kind, indices)
    pools.pools_dir(run).mkdir(mode=0o700, exist_ok=True)
    pools.config_path(run, name).write_text(to_toml(pool_cfg))
    pools.save(run, record)
    record.job_id = extra.submit_pool(pool_cfg, run.path, name, pools.config_path(run, name), spec)
    pools.save(run, record)
    return record


def wait_registered(run: RunDir, record: pools.PoolRecord, proc: subprocess.Popen, timeout_s: float) -> None:
    """Block until every engine of the pool registered; stop the pool and raise when it cannot."""
    deadline = time.monotonic() + timeout_s
    files = [run.rendezvous / f"engine-{i}.json" for i in record.indices]
    while not all(f.exists() for f in files):
        if proc.poll() is not None or time.monotonic() > deadline:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=60)
            record.state = "ended"
            pools.save(run, record)
            raise RuntimeError(f"the pool's engines did not register; see {run.logs / (record.name + '.log')} "
                               f"and {run.logs}/engine-{record.indices[0]}.log")  # fmt: skip
        time.sleep(0.2)


def engine_load(run: RunDir) -> dict[int, dict]:
    """The router's view of each engine (requests, health, version), by index; empty when it is down."""
    url = router_url(run)
    if url is None:
        return {}
    try:
        return {e["index"]: e for e in http_json(url + "/metrics", run.token())["engines"]}
    except (OSError, ValueError, KeyError):
        return {}


def pool_rows(run: RunDir, slurm_state=None) -> list[dict]:
    """One row per pool: name, mode, job or pid, engines, versions served, requests, state."""
    load = engine_load(run)
    rows = []
    for rec in pools.records(run):
        state = rec.state if not rec.live or pools.running(rec, slurm_state) else "ended"
        versions, requests, in_ring = set(), 0, 0
        for index in rec.indices:
            with contextlib.suppress(OSError, ValueError):  # not registered, or rewritten after a refit
                versions.add(json.loads((run.rendezvous / f"engine-{index}.json").read_text()).get("version"))
            seen = load.get(index, {})
            requests += seen.get("total", 0)
            in_ring += bool(seen.get("healthy"))
        rows.append({"pool": rec.name, "mode": rec.mode, "job": rec.job_id or f"pid {rec.pid}", "engines":
                     len(rec.indices), "in_ring": in_ring, "versions": sorted(v for v in versions if v is not None),
                     "requests": requests, "state": state})  # fmt: skip
    return rows


def remove(run_dir: str, name: str, drain_s: float, cancel=None) -> pools.PoolRecord:
    """Drain and stop a pool (`cancel(job_id)` ends a Slurm pool's job)."""
    run, cfg = open_run(run_dir)
    record = pools.load(run, name)
    if not record.live:
        raise ValueError(f"pool {name} is already {record.state}: nothing to remove")
    record.state = "draining"
    pools.save(run, record)
    urls = [url for url in map(registered_url, [run.rendezvous / f"engine-{i}.json" for i in record.indices]) if url]
    pools.unregister(run, record.indices)  # no new work from the router's next scan; the next refit skips them
    time.sleep(2 * cfg.router.health_interval_s)  # the router's scan saw it (later arrivals continue elsewhere)
    deadline = time.monotonic() + drain_s
    while time.monotonic() < deadline and sum(held(url, run.token()) for url in urls):
        time.sleep(0.2)
    if record.mode == "local" and pools.pid_alive(record.pid):
        os.kill(record.pid, signal.SIGTERM)
        deadline = time.monotonic() + 60
        while pools.pid_alive(record.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
    elif record.mode == "slurm" and cancel is not None:
        cancel(record.job_id)
    record = pools.load(run, name)
    record.state = "removed"
    pools.save(run, record)
    return record


def registered_url(path: Path) -> str | None:
    try:
        return json.loads(path.read_text())["url"]
    except (OSError, ValueError, KeyError):
        return None


def held(url: str, token: str) -> int:
    """Requests the engine at `url` runs or holds (0 once it stopped answering)."""
    try:
        status = http_json(url + "/health", token, timeout=2.0)
    except (OSError, ValueError):
        return 0
    return int(status.get("running", 0)) + int(status.get("waiting", 0))
