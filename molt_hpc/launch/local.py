"""Local mode: the whole RL loop on one machine, as subprocesses (`molt-hpc run`).

Two children, the same entry points a Slurm job runs: the actor pool (`torchrun … jobs/actor.py`)
and the engine pool (`jobs/engine.py --role pool`: engines, router, orchestrator). The launcher
supervises them: training done → stop the pool, exit 0; any child dies → stop the other, say which
died with the tail of its log, exit 1; Ctrl-C / SIGTERM → ask the trainer to checkpoint at the next
step boundary (`control/stop`), wait for it, stop the pool. A second Ctrl-C stops at once.
"""

import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path

from molt_hpc.buffer.cleanup import release_finished
from molt_hpc.config import MoltConfig, to_toml
from molt_hpc.launch.procs import REPO, Child, exit_report, job_command, stop_all
from molt_hpc.launch.progress import Progress
from molt_hpc.log import MetricsWriter, get_logger
from molt_hpc.models import resolve_model
from molt_hpc.rundir import RunDir, atomic_write, create_run_dir
from molt_hpc.trackers import Trackers, check_optional_packages

STOP_WAIT_S = 300.0


def prepare_run(cfg: MoltConfig) -> RunDir:
    """The run directory with the resolved config, its token and the built model."""
    run = create_run_dir(cfg.run.root, cfg.run.name, to_toml(cfg))
    (run.path / "control").mkdir(exist_ok=True)
    for stale in ("done", "stop", "checkpoint"):  # leftovers of an earlier, finished or stopped launch
        (run.path / "control" / stale).unlink(missing_ok=True)
    resolve_model(cfg.model, run.models)
    return run


def visible_gpus() -> list[str]:
    """GPU ids this launcher may hand out: `CUDA_VISIBLE_DEVICES`, or every GPU torch sees."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [g for g in env.split(",") if g.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def split_gpus(cfg: MoltConfig, gpus: list[str]) -> tuple[list[str], list[str]]:
    """(actor pool GPUs, engine pool GPUs): disjoint when there are enough, else both share them all."""
    actor_n = 0 if cfg.actor.device == "cpu" else cfg.actor.ranks
    engine_n = 0 if cfg.engines.device == "cpu" else cfg.engines.count * cfg.engines.tensor_parallel
    if not gpus or actor_n + engine_n == 0:
        return [], []
    if len(gpus) >= actor_n + engine_n:
        return gpus[:actor_n], gpus[actor_n : actor_n + engine_n]
    get_logger().warning(
        "%d GPU(s) for %d trainer rank(s) and %d engine GPU(s): the pools share them", len(gpus), actor_n, engine_n
    )
    return gpus[: max(actor_n, 1)] if actor_n else [], gpus if engine_n else []


def _gpu_env(gpus: list[str]) -> dict[str, str]:
    # An empty list hides every GPU, so a CPU-only pool never grabs one by accident.
    return {"CUDA_VISIBLE_DEVICES": ",".join(gpus)}


def actor_child(cfg: MoltConfig, run: RunDir) -> Child:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc-per-node", str(cfg.actor.ranks), str(REPO / "jobs" / "actor.py"), str(run.path),
    ]  # fmt: skip
    return Child("actor pool", cmd, run.logs / "actor.log", {"OMP_NUM_THREADS": "1"})


def run_local(cfg: MoltConfig) -> int:
    """Run (or continue) `cfg`'s run on this machine; returns the process exit code."""
    log = get_logger()
    check_optional_packages(cfg)
    if cfg.actor.ranks % cfg.actor.cp:
        raise ValueError(
            f"actor.ranks ({cfg.actor.ranks}) is not a multiple of actor.cp ({cfg.actor.cp}): each CP group "
            "needs cp trainer ranks"
        )
    run = prepare_run(cfg)
    log.info("run directory %s", run.path)
    pool = Child("engine pool", job_command("engine.py", str(run.path), "--role", "pool"), run.logs / "pool.log")
    actor = actor_child(cfg, run)
    gpus = visible_gpus()
    if gpus:
        actor_gpus, pool_gpus = split_gpus(cfg, gpus)
        actor.env.update(_gpu_env(actor_gpus))
        pool.env.update(_gpu_env(pool_gpus))
        log.info("GPUs: actor pool %s, engine pool %s", actor_gpus or "none", pool_gpus or "none")
    trackers = Trackers(cfg.logging, run, cfg.run.name)
    children = [pool.start(), actor.start()]
    atomic_write(run.path / "processes.json", json.dumps({c.name: c.pid for c in children}))
    progress = Progress(cfg, run, trackers)
    interrupts = 0

    def on_signal(signum, _frame):
        nonlocal interrupts
        interrupts += 1
        if interrupts == 1:
            log.info("stopping: the trainer checkpoints at the next step boundary (Ctrl-C again to stop now)")
            (run.path / "control" / "stop").touch()
        else:
            raise KeyboardInterrupt

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = _supervise(run, actor, pool, progress, lambda: interrupts > 0)
    except KeyboardInterrupt:
        log.warning("stopped at once; resume from the last checkpoint with: molt-hpc run --resume %s", run.path)
        code = 130
    finally:
        codes = stop_all(children)
        log.info("stopped: %s", exit_report(codes))
        progress.close()
        trackers.close()
        for s, handler in old.items():
            signal.signal(s, handler)
    removed = release_finished(run.path) if code == 0 else None  # a stopped run keeps its spool to resume from
    if removed is not None:
        log.info("removed the finished run's replay buffer %s", removed)
    return code


def _supervise(run: RunDir, actor: Child, pool: Child, progress: Progress, stopping) -> int:
    log = get_logger()
    stop_deadline = None
    while True:
        time.sleep(0.5)
        progress.update()
        if stopping() and stop_deadline is None:
            stop_deadline = time.monotonic() + STOP_WAIT_S
        code = actor.poll()
        if code is not None:
            progress.update()
            if code == 0 and (run.path / "control" / "done").exists():
                record_engine_versions(run)
                progress.summary()
                return 0
            if code == 0 and stopping():
                log.info("stopped after a checkpoint; continue with: molt-hpc run --resume %s", run.path)
                return 0
            return _died(actor, code, run)
        code = pool.poll()
        # The orchestrator ends on its own once training is done or a stop was asked: wait for the trainer.
        finishing = stopping() or (run.path / "control" / "done").exists()
        if code is not None and not (code == 0 and finishing):
            return _died(pool, code, run)
        if stop_deadline is not None and time.monotonic() > stop_deadline:
            log.error("the trainer did not stop within %.0f s; stopping everything", STOP_WAIT_S)
            return 1


def record_engine_versions(run: RunDir) -> dict[str, int]:
    """Log and record the weight version each engine serves at the end (it must be the trainer's last)."""
    versions = {}
    for path in sorted(run.rendezvous.glob("engine-*.json")):
        with contextlib.suppress(OSError, ValueError):  # an engine restarting re-registers; skip its old file
            versions[path.stem] = json.loads(path.read_text())["version"]
    MetricsWriter(run.metrics, source="launcher").write({"event": "finished", "engine_versions": versions})
    get_logger().info("engines serve weight versions %s", versions)
    return versions


def _died(child: Child, code: int, run: RunDir) -> int:
    get_logger().error(
        "%s exited with code %s; stopping the run. Last lines of %s:\n%s\nContinue from the last checkpoint with: "
        "molt-hpc run --resume %s",
        child.name, code, child.log, child.tail(), run.path,
    )  # fmt: skip
    return 1


def resume_config(run_dir: str | Path, overrides: tuple[str, ...]) -> MoltConfig:
    """The config a stopped run ran with (plus overrides), pointed at that directory wherever it now is."""
    from molt_hpc.config import load_config

    path = Path(run_dir).absolute()
    if not (path / "config.toml").is_file():
        raise ValueError(f"{path} is not a run directory (no config.toml); pass the directory a run printed")
    where = [f"run.root={json.dumps(str(path.parent))}", f"run.name={json.dumps(path.name)}"]
    cfg = load_config(path / "config.toml", [*where, *overrides])
    if cfg.checkpoint.resume == "never":
        raise ValueError("checkpoint.resume = 'never' in this run's config; --resume needs 'auto' or 'required'")
    return cfg
