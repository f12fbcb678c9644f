"""The process that runs one extra engine pool: `jobs/engine.py RUN_DIR --role extra-pool --pool NAME`.

It starts the pool's engines (`--role engine --index I --config pools/NAME.toml`), restarts one that
dies (up to `engines.max_restarts`; an extra pool's trouble never stops the run), and on SIGTERM (a
`molt-hpc engines remove` after its drain, a Slurm preemption, cancellation or time limit) stops them:
each engine unregisters, and the requests still in flight continue on the run's other engines from
the tokens they had streamed. The pool's record then says `ended` unless a removal already said why.

Slurm's warning signal (`WARNING_SIGNAL`, `slurm.signal_lead_s` before the time limit, and at once on a
preemption where slurmctld sends it) reaches every process of the job step. The supervisor alone acts
on it: the pool leaves the ring (its registrations go, so the router sends it nothing new and the next
refit leaves it out) while its engines finish what they hold, until the SIGTERM that ends the job. The
engines start with it blocked, so it never ends one before its requests are handed on.
"""

import os
import signal
import time

from molt_hpc.config import MoltConfig
from molt_hpc.launch import pools
from molt_hpc.launch.pool import engine_env
from molt_hpc.launch.procs import Child, exit_report, job_command, stop_all
from molt_hpc.log import get_logger
from molt_hpc.rundir import RunDir

WARNING_SIGNAL = signal.SIGUSR2
"""The signal a Slurm pool job asks for before its time limit (`#SBATCH --signal=USR2@<signal_lead_s>`)."""


def engine_children(cfg: MoltConfig, run: RunDir, record: pools.PoolRecord) -> list[Child]:
    """One engine process per index of the pool, with its share of this node's GPUs."""
    config = str(pools.config_path(run, record.name))
    node = int(os.environ.get("SLURM_NODEID", "0"))  # a Slurm pool over several nodes: this node's engines
    mine = record.indices[node * cfg.engines.count : (node + 1) * cfg.engines.count] or record.indices
    children = []
    for local, index in enumerate(mine):
        cmd = job_command("engine.py", str(run.path), "--role", "engine", "--index", str(index), "--config", config)
        log = run.logs / f"engine-{index}.log"
        children.append(Child(f"engine {index}", cmd, log, engine_env(cfg, local), blocked=(WARNING_SIGNAL,)))
    return children


def run_extra_pool(cfg: MoltConfig, run: RunDir, name: str) -> int:
    """Supervise the pool's engines until SIGTERM (exit 0) or until every one of them gave up (exit 1)."""
    log = get_logger()
    record = pools.load(run, name)
    children = engine_children(cfg, run, record)
    got: dict[str, str] = {}

    def on_signal(signum, _frame):
        got.setdefault("stop" if signum != WARNING_SIGNAL else "warning", signal.Signals(signum).name)

    for sig in (signal.SIGTERM, signal.SIGINT, WARNING_SIGNAL):  # (a Slurm pool's task ignores the warning until now)
        signal.signal(sig, on_signal)
    for child in children:
        child.start()
        log.info("started %s (pid %d, log %s)", child.name, child.pid, child.log)
    if record.state in ("starting", "ended"):  # (ended: a requeued Slurm pool starting again)
        record.state = "serving"
        pools.save(run, record)
    try:
        supervise(cfg, run, name, children, got)
    finally:
        codes = stop_all(children)
        log.info("pool %s stopped on %s: %s", name, got.get("stop", "the loss of its engines"), exit_report(codes))
        pools.unregister(run, record.indices)
        ended = pools.load(run, name)
        if ended.live:
            ended.state = "ended"
            pools.save(run, ended)
    return 0 if "stop" in got else 1


def supervise(cfg: MoltConfig, run: RunDir, name: str, children: list[Child], got: dict[str, str]) -> None:
    """Restart engines that die until a stop signal; after the warning, keep the pool out of the ring and
    restart none (a restarted engine would register again)."""
    log = get_logger()
    indices = pools.load(run, name).indices
    given_up: set[str] = set()
    while "stop" not in got and len(given_up) < len(children):
        time.sleep(0.5)
        if "warning" in got:
            leave_ring(run, name, indices, got["warning"])
        for child in children:
            code = child.poll()
            if code is None or "stop" in got or child.name in given_up:
                continue
            if "warning" in got or child.restarts >= cfg.engines.max_restarts:
                log.error("%s died (exit %s, %d restarts); the pool goes on without it\n%s", child.name, code,
                          child.restarts, child.tail())  # fmt: skip
                given_up.add(child.name)
                continue
            child.restarts += 1
            log.warning("%s died (exit %s); restarting it (%d/%d)", child.name, code, child.restarts,
                        cfg.engines.max_restarts)  # fmt: skip
            child.start()


def leave_ring(run: RunDir, name: str, indices: list[int], signame: str) -> None:
    """Slurm's warning: the pool's registrations go (the router sends nothing new, the next refit leaves the
    pool out) while its engines finish what they hold. Called at every turn after it: an engine that was still
    starting, or one a refit in flight rewrote, registers anew."""
    pools.unregister(run, indices)
    record = pools.load(run, name)
    if record.state in ("starting", "serving"):
        get_logger().info("pool %s: %s (the time limit is near, or a preemption): left the ring; its engines "
                          "finish what they hold until the job ends", name, signame)  # fmt: skip
        record.state = "draining"
        pools.save(run, record)
