"""Local mode: the whole RL loop on one machine, as subprocesses (`molt-hpc run`).

Two children, the same entry points a Slurm job runs: the actor pool (`torchrun … jobs/actor.py`, or for one
rank `jobs/actor.py` alone) and the engine pool (`jobs/engine.py --role pool`: engines, router, orchestrator).
The launcher supervises them: training done → stop the pool, exit 0; a circuit breaker trips (a cause recorded
in `control/failed`, or no step for `run.stall_timeout_s`) → the trainer checkpoints, everything stops, one
line says why, exit 1; a child dies → stop the other, say which died (its `error:` line when it refused its
input, else the tail of its log), exit 1; Ctrl-C / SIGTERM → ask the trainer to checkpoint at the next step
boundary (`control/stop`), wait for it, stop the pool. A second Ctrl-C stops at once. The resume command is
offered only when a checkpoint exists to resume from.

With fewer GPUs than the pools ask for, both pools share them (one GPU: the trainer and the engine on
it; the refit then goes through CUDA IPC). vLLM sizes its KV cache from the memory it finds free at
start, so when vLLM engines share the trainer's GPU the trainer starts only once they registered.
"""

import contextlib
import json
import os
import sys
import time
from pathlib import Path

from molt_hpc import fault, net
from molt_hpc.buffer.cleanup import release_finished
from molt_hpc.config import MoltConfig, to_toml
from molt_hpc.launch import pools
from molt_hpc.launch.procs import REPO, Child, StopSignals, exit_report, job_command, stop_all
from molt_hpc.launch.progress import Progress
from molt_hpc.launch.watchdog import Watchdog
from molt_hpc.log import MetricsWriter, get_logger, log_tail
from molt_hpc.models import resolve_model
from molt_hpc.parallel.ep_check import check_ep, model_experts
from molt_hpc.rundir import RunDir, atomic_write, create_run_dir, private_files
from molt_hpc.trackers import Trackers, check_optional_packages

STOP_WAIT_S = 300.0


def prepare_run(cfg: MoltConfig) -> RunDir:
    """The run directory with the resolved config, its token and the built model."""
    run = create_run_dir(cfg.run.root, cfg.run.name, to_toml(cfg))
    (run.path / "control").mkdir(exist_ok=True)
    for stale in ("done", "stop", "checkpoint", "evaluated"):  # leftovers of an earlier, finished or stopped launch
        (run.path / "control" / stale).unlink(missing_ok=True)
    fault.clear(run.path)
    for kept in pools.reconcile(run):  # extra pools that ended with the last launch are forgotten
        get_logger().info("extra pool %s still runs (engines %s): it serves this launch too", kept.name, kept.indices)
    base = resolve_model(cfg.model, run.models)
    check_ep(cfg.actor.ep, cfg.actor.ranks, cfg.actor.ranks, model_experts(base))  # one node: all ranks
    return run


def visible_gpus() -> list[str]:
    """GPU ids this launcher may hand out: `CUDA_VISIBLE_DEVICES`, or every GPU torch sees (none without a driver)."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [g for g in env.split(",") if g.strip()]
    from molt_hpc.devices import device_gpu_count

    return [str(i) for i in range(device_gpu_count())]


LOOPBACK_ENV = {
    net.LOOPBACK_ENV: "1",
    "MASTER_ADDR": "127.0.0.1",
    "GLOO_SOCKET_IFNAME": "lo",
    "NCCL_SOCKET_IFNAME": "lo",
}
"""Every child of a local run listens on loopback only: TCPStore servers (`molt_hpc.net.listen_fd`), gloo's
and NCCL's connection sockets (their interface), the engines, router and scorers (`engines.host`)."""


def split_gpus(cfg: MoltConfig, gpus: list[str]) -> tuple[list[str], list[str]]:
    """(actor pool GPUs, engine pool GPUs): disjoint when there are enough, else both share them all."""
    actor_n = 0 if cfg.actor.device == "cpu" else cfg.actor.ranks
    engine_n = 0 if cfg.engines.device == "cpu" else cfg.engines.count * cfg.engines.gpus_per_engine
    for sec in (cfg.reward_model, cfg.distill):  # scorers, then teachers, come after the engines
        engine_n += 0 if sec is None or sec.device == "cpu" else sec.count
    if not gpus or actor_n + engine_n == 0:
        return [], []
    if len(gpus) >= actor_n + engine_n:
        return gpus[:actor_n], gpus[actor_n : actor_n + engine_n]
    get_logger().warning(
        "%d GPU(s) for %d trainer rank(s) and %d engine GPU(s): the pools share them", len(gpus), actor_n, engine_n
    )
    return gpus[: max(actor_n, 1)] if actor_n else [], gpus if engine_n else []


def gpu_env(gpus: list[str]) -> dict[str, str]:
    # An empty list hides every GPU, so a CPU-only pool never grabs one by accident.
    return {"CUDA_VISIBLE_DEVICES": ",".join(gpus)}


def actor_child(cfg: MoltConfig, run: RunDir) -> Child:
    """The actor pool: torchrun over `actor.ranks` ranks, or for one rank the rank itself (a world of one
    needs no rendezvous, and skipping torchrun's agent saves a Python process and its torch import)."""
    script = str(REPO / "jobs" / "actor.py")
    if cfg.actor.ranks == 1:
        cmd = [sys.executable, script, str(run.path)]
    else:
        cmd = [
            sys.executable, "-m", "molt_hpc.launch.torchrun", "--standalone", "--local-addr", "127.0.0.1",
            "--nproc-per-node", str(cfg.actor.ranks), script, str(run.path),
        ]  # fmt: skip
    return Child("actor pool", cmd, run.logs / "actor.log", {"OMP_NUM_THREADS": "1", **LOOPBACK_ENV})


def run_local(cfg: MoltConfig) -> int:
    """Run (or continue) `cfg`'s run on this machine; returns the process exit code."""
    log = get_logger()
    private_files()  # the launcher writes logs, metrics and the run directory itself
    _check_local(cfg)
    run = prepare_run(cfg)
    log.info("run directory %s", run.path)
    resumed = _latest(run)
    if resumed is not None:
        log.info("resuming from checkpoint %s (step %d of %d)", resumed[0].name, resumed[1], cfg.run.steps)
    pool_cmd = job_command("engine.py", str(run.path), "--role", "pool")
    pool = Child("engine pool", pool_cmd, run.logs / "pool.log", dict(LOOPBACK_ENV))
    actor = actor_child(cfg, run)
    gpus = visible_gpus()
    vllm_first = False
    if gpus:
        actor_gpus, pool_gpus = split_gpus(cfg, gpus)
        actor.env.update(gpu_env(actor_gpus))
        pool.env.update(gpu_env(pool_gpus))
        log.info("GPUs: actor pool %s, engine pool %s", actor_gpus or "none", pool_gpus or "none")
        vllm_first = cfg.engines.kind == "vllm" and bool(set(actor_gpus) & set(pool_gpus))
    # Where the run ran, for the speed model's comparison (`status`): a config with Slurm GPU counts may run here.
    MetricsWriter(run.metrics, source="launcher").write({"event": "placement", "mode": "local", "gpus": len(gpus)})
    trackers = Trackers(cfg.logging, run, cfg.run.name)
    progress = Progress(cfg, run, trackers, start_step=resumed[1] if resumed else 0)  # before a child writes
    watchdog = Watchdog(cfg, run.path)
    children = [pool.start()]
    stops = StopSignals(run.path)
    summary = None
    try:
        if vllm_first:
            log.info(
                "vLLM shares the trainer's GPU and reserves engines.gpu_memory_utilization = %s of it: the trainer "
                "starts once the engines are up", cfg.engines.gpu_memory_utilization,
            )  # fmt: skip
            code = _wait_for_engines(cfg, run, pool, lambda: stops.count > 0)
            if code is not None:
                return code
        children.append(actor.start())
        record = {"launcher": os.getpid(), **{c.name: c.pid for c in children}}
        atomic_write(run.path / "processes.json", json.dumps(record))
        code = _supervise(run, actor, pool, progress, watchdog, lambda: stops.count > 0, cfg.eval is not None)
        if code == 0 and (run.path / "control" / "done").exists():  # trained to the end: summarised
            summary = progress.summary
    except KeyboardInterrupt:
        log.warning("stopped at once%s", _resume_hint(run, "; continue from checkpoint {name} with: "))
        code = 130
    finally:
        codes = stop_all(children, meanwhile=summary)  # the summary and its plot while the pools stop
        log.info("stopped: %s", exit_report(codes))
        progress.close()
        trackers.close()
        stops.restore()
    removed = release_finished(run.path) if code == 0 else None  # a stopped run keeps its spool to resume from
    if removed is not None:
        log.info("removed the finished run's replay buffer %s", removed)
    return code


def _check_local(cfg: MoltConfig) -> None:
    """What a run on one machine cannot do, refused with the change to make."""
    check_optional_packages(cfg)
    if cfg.actor.ranks % cfg.actor.cp:
        raise ValueError(
            f"actor.ranks ({cfg.actor.ranks}) is not a multiple of actor.cp ({cfg.actor.cp}): each CP group "
            "needs cp trainer ranks"
        )
    if cfg.engines.nodes_per_engine > 1:
        raise ValueError(
            f"engines.nodes_per_engine = {cfg.engines.nodes_per_engine} spans an engine over several nodes but a "
            "local run has one: submit it to Slurm (`molt-hpc submit`), or set engines.nodes_per_engine = 1"
        )


def _wait_for_engines(cfg: MoltConfig, run: RunDir, pool: Child, stopping) -> int | None:
    """Wait until every engine registered (None), or return the run's exit code: the pool died, a stop
    was asked, or the engines took longer than `engines.startup_timeout_s`."""
    deadline = time.monotonic() + cfg.engines.startup_timeout_s + 60
    while _live_registrations(run) < cfg.engines.count:
        code = pool.poll()
        if code is not None:
            return child_died(pool, code, run)
        if stopping():
            return 0
        if time.monotonic() > deadline:
            get_logger().error("the engines did not register within engines.startup_timeout_s; see %s", pool.log)
            return 1
        time.sleep(0.5)
    return None


def _live_registrations(run: RunDir) -> int:
    """Engines registered by a process that still runs (a crashed launch leaves its files behind)."""
    live = 0
    for path in run.rendezvous.glob("engine-*.json"):
        with contextlib.suppress(OSError, ValueError, KeyError):  # being replaced, or its process is gone
            os.kill(int(json.loads(path.read_text())["pid"]), 0)
            live += 1
    return live


def final_eval_pending(run_dir: Path, evaluates: bool) -> bool:
    """Training is done and the orchestrator still evaluates the last version (`[eval]`): keep the engines."""
    control = Path(run_dir) / "control"
    return evaluates and (control / "done").exists() and not (control / "evaluated").exists()


def _supervise(
    run: RunDir, actor: Child, pool: Child, progress: Progress, watchdog: Watchdog, interrupted, evaluates: bool
) -> int:
    log = get_logger()
    stop_deadline = None
    while True:
        actor.wait(0.5)  # every half second, and at once when the trainer exits
        progress.update()
        failure = watchdog.check()
        stopping = interrupted() or failure is not None
        if stopping and stop_deadline is None:
            stop_deadline = time.monotonic() + STOP_WAIT_S
        done = (run.path / "control" / "done").exists()
        code = actor.poll()
        if code is not None:
            progress.update()
            if code == 0 and done and final_eval_pending(run.path, evaluates) and pool.poll() is None:
                continue  # the orchestrator ends on its own after the final evaluation
            if code == 0 and done:  # the caller prints the summary while the pools stop
                record_engine_versions(run)
                return 0
            failure = watchdog.check()  # the trainer may have stopped for a cause another process recorded
            if failure is not None:
                return _failed(run, failure, clean=code == 0)
            if code == 0 and interrupted():
                log.info("stopped after a checkpoint%s", _resume_hint(run, "; continue with: "))
                return 0
            return child_died(actor, code, run)
        code = pool.poll()
        # The orchestrator ends on its own once training is done or a stop was asked: wait for the trainer.
        if code is not None and not (code == 0 and (stopping or done)) and watchdog.check() is None:
            return child_died(pool, code, run)
        if stop_deadline is not None and time.monotonic() > stop_deadline:
            log.error("the trainer did not stop within %.0f s; stopping everything", STOP_WAIT_S)
            return 1


def _latest(run: RunDir) -> tuple[Path, int] | None:
    """(the newest whole checkpoint, its step), or None."""
    from molt_hpc import checkpoint as ck

    with contextlib.suppress(ValueError, OSError, KeyError):
        latest = ck.latest_checkpoint(run.checkpoints)
        if latest is not None:
            return latest, int(ck.read_run_state(latest)["step"])
    return None


def _resume_hint(run: RunDir, lead: str) -> str:
    """`lead` + the resume command when there is a checkpoint to continue from, else nothing: a resume
    with nothing to resume from starts over, which is not what the hint would promise."""
    latest = _latest(run)
    if latest is None:
        return ""
    return lead.format(name=latest[0].name) + f"molt-hpc run --resume {run.path}"


def record_engine_versions(run: RunDir) -> dict[str, int]:
    """Log and record the weight version each engine serves at the end (it must be the trainer's last)."""
    versions = {}
    for path in sorted(run.rendezvous.glob("engine-*.json")):
        with contextlib.suppress(OSError, ValueError):  # an engine restarting re-registers; skip its old file
            versions[path.stem] = json.loads(path.read_text())["version"]
    MetricsWriter(run.metrics, source="launcher").write({"event": "finished", "engine_versions": versions})
    get_logger().info("engines serve weight versions %s", versions)
    return versions


def _failed(run: RunDir, failure: dict, clean: bool) -> int:
    """One line: why the run stopped; the resume command only when a checkpoint holds and a fix can help."""
    hint = ""
    if clean and not failure.get("config_error"):
        hint = _resume_hint(run, "; checkpoint {name} holds the run: once fixed, continue with: ")
    get_logger().error("run stopped: %s%s", failure["reason"], hint)
    return 1


def child_died(child: Child, code: int, run: RunDir) -> int:
    log = get_logger()
    user_error = user_error_line(child.log) if code == 2 else None
    if user_error is not None:  # the child refused its input: that line is the whole story
        log.error("%s stopped: %s", child.name, user_error)
        return 1
    log.error(
        "%s exited with code %s; stopping the run. Last lines of %s:\n%s%s",
        child.name, code, child.log, child.tail(), _resume_hint(run, "\nContinue from checkpoint {name} with: "),
    )  # fmt: skip
    return 1


def user_error_line(log_path: Path) -> str | None:
    """The last `error: ...` line a process printed for its user (exit code 2), without the prefix."""
    for line in reversed(log_tail(log_path, 40).splitlines()):
        if line.startswith("error: "):
            return line.removeprefix("error: ")
    return None


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
    from molt_hpc.launch.preflight import check_resume

    check_resume(path, cfg)
    return cfg
