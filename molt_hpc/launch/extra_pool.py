"""The process that runs one extra engine pool: `jobs/engine.py RUN_DIR --role extra-pool --pool NAME`.

It starts the pool's engines (`--role engine --index I --config pools/NAME.toml`), restarts one that
dies (up to `engines.max_restarts`; an extra pool's trouble never stops the run), and on SIGTERM (a
`molt-hpc engines remove` after its drain, a Slurm preemption, cancellation or time limit) stops them:
each engine unregisters, and the requests still in flight continue on the run's other engines from
the tokens they had streamed. The pool's record then says `ended` unless a removal already said why.
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


def engine_children(cfg: MoltConfig, run: RunDir, record: pools.PoolRecord) -> list[Child]:
    """One engine process per index of the pool, with its share of this node's GPUs."""
    config = str(pools.config_path(run, record.name))
    node = int(os.environ.get("SLURM_NODEID", "0"))  # a Slurm pool over several nodes: this node's engines
    mine = record.indices[node * cfg.engines.count : (node + 1) * cfg.engines.count] or record.indices
    children = []
    for local, index in enumerate(mine):
        cmd = job_command("engine.py", str(run.path), "--role", "engine", "--index", str(index), "--config", config)
        children.append(Child(f"engine {index}", cmd, run.logs / f"engine-{index}.log", engine_env(cfg, local)))
    return children


def run_extra_pool(cfg: MoltConfig, run: RunDir, name: str) -> int:
    """Supervise the pool's engines until SIGTERM (exit 0) or until every one of them gave up (exit 1)."""
    log = get_logger()
    record = pools.load(run, name)
    children = engine_children(cfg, run, record)
    stopping = False

    def on_term(signum, _frame):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    for child in children:
        child.start()
        log.info("started %s (pid %d, log %s)", child.name, child.pid, child.log)
    if record.state in ("starting", "ended"):  # (ended: a requeued Slurm pool starting again)
        record.state = "serving"
        pools.save(run, record)
    given_up: set[str] = set()
    try:
        while not stopping and len(given_up) < len(children):
            time.sleep(0.5)
            for child in children:
                code = child.poll()
                if code is None or stopping or child.name in given_up:
                    continue
                if child.restarts >= cfg.engines.max_restarts:
                    log.error("%s died %d times; the pool goes on without it\n%s", child.name, child.restarts + 1,
                              child.tail())  # fmt: skip
                    given_up.add(child.name)
                    continue
                child.restarts += 1
                log.warning("%s died (exit %s); restarting it (%d/%d)", child.name, code, child.restarts,
                            cfg.engines.max_restarts)  # fmt: skip
                child.start()
    finally:
        codes = stop_all(children)
        log.info("pool %s stopped: %s", name, exit_report(codes))
        pools.unregister(run, record.indices)
        ended = pools.load(run, name)
        if ended.live:
            ended.state = "ended"
            pools.save(run, ended)
    return 0 if stopping else 1
