"""The engine pool of one node: its engines and, on the pool's first node, the router and orchestrator.

Run as `jobs/engine.py RUN_DIR --role pool` by both launchers (a local subprocess, or one
`srun --het-group=1` task per node), with a `[reward_model]`'s scorers, a `[distill]`'s teachers and the
`[sandbox]` server on the first node. A dead engine (or scorer, teacher, or sandbox) is restarted in place
(the router takes it out of the ring meanwhile, the trainer re-forms the refit group when it re-registers),
and so is a dead router (it holds no state; the orchestrator retries the requests it lost at the new
address); one that keeps dying past `engines.max_restarts` ends the pool with the cause recorded for the
run, and an orchestrator that fails ends the pool with an error, which ends the run. The pool itself ends
only when its launcher stops it (SIGTERM), so engines still answer after training is done.

An engine over several nodes (`engines.nodes_per_engine > 1`) is one engine process per node: node
`n` hosts part `n mod nodes_per_engine` of engine `n // nodes_per_engine` (its nodes are consecutive
in the het group), and only part 0 serves and registers it.
"""

import os
import signal
import time

from molt_hpc.config import MoltConfig
from molt_hpc.fault import fail
from molt_hpc.launch.procs import Child, exit_report, job_command, stop_all
from molt_hpc.log import get_logger
from molt_hpc.rundir import RunDir


def node_engines(cfg: MoltConfig, node_rank: int) -> list[tuple[int, int]]:
    """(engine index, this node's rank in that engine) of each engine process node `node_rank` runs."""
    eng = cfg.engines
    if eng.nodes_per_engine == 1:
        return [(node_rank * eng.count + local, 0) for local in range(eng.count)]
    return [divmod(node_rank, eng.nodes_per_engine)]


def engine_env(cfg: MoltConfig, local_index: int) -> dict[str, str]:
    """Threads and GPUs of one engine process: GPUs are split evenly across the node's engines (a
    multi-node engine takes its share of every one of its nodes)."""
    env = {"OMP_NUM_THREADS": str(cfg.engines.threads or 1)}
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        gpus = visible.split(",")
        n = cfg.engines.gpus_per_engine_node
        mine = gpus[local_index * n : (local_index + 1) * n]
        if len(mine) < n:
            raise ValueError(
                f"engine {local_index} needs {n} GPUs but the node has {len(gpus)} for {cfg.engines.count} "
                "engines: lower engines.count, engines.tensor_parallel or engines.data_parallel"
            )
        env["CUDA_VISIBLE_DEVICES"] = ",".join(mine)
    return env


def scorer_env(cfg: MoltConfig, index: int, role: str = "scorer") -> dict[str, str]:
    """A scoring process's threads and GPU: the node's first GPU after the engines' (a teacher's after the
    reward-model scorers' too), else the last one."""
    sec = cfg.reward_model if role == "scorer" else cfg.distill
    assert sec is not None
    env = {"OMP_NUM_THREADS": "1"}
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if sec.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    elif visible:
        gpus = visible.split(",")
        after = len(node_engines(cfg, 0)) * cfg.engines.gpus_per_engine_node + index
        rm = cfg.reward_model
        after += 0 if role == "scorer" or rm is None or rm.device == "cpu" else rm.count
        env["CUDA_VISIBLE_DEVICES"] = gpus[after] if after < len(gpus) else gpus[-1]
    return env


def sandbox_child(run: RunDir) -> Child:
    """The sandbox server: restarted like an engine, and it never sees a GPU."""
    cmd = job_command("engine.py", str(run.path), "--role", "sandbox")
    return Child("sandbox", cmd, run.logs / "sandbox.log", {"CUDA_VISIBLE_DEVICES": ""})


def pool_children(
    cfg: MoltConfig, run: RunDir, node_rank: int, with_sandbox: bool = True
) -> tuple[list[Child], list[Child]]:
    """(engines, services) this node runs: engines (and on node 0 the reward-model scorers, the distillation
    teachers and, unless a Slurm het group of its own runs it, the sandbox) are restarted when they die;
    services are the router and orchestrator on node 0."""
    engines = []
    for local, (index, part) in enumerate(node_engines(cfg, node_rank)):
        cmd = job_command("engine.py", str(run.path), "--role", "engine", "--index", str(index))
        name, log = f"engine {index}", run.logs / f"engine-{index}.log"
        if part:  # a headless part of a multi-node engine
            cmd += ["--engine-node", str(part)]
            name, log = f"engine {index} node {part}", run.logs / f"engine-{index}-node{part}.log"
        engines.append(Child(name, cmd, log, engine_env(cfg, local)))
    for role, sec in (("scorer", cfg.reward_model), ("teacher", cfg.distill)):
        for index in range(sec.count if sec is not None and node_rank == 0 else 0):
            cmd = job_command("engine.py", str(run.path), "--role", role, "--index", str(index))
            log = run.logs / f"{role}-{index}.log"
            engines.append(Child(f"{role} {index}", cmd, log, scorer_env(cfg, index, role)))
    if node_rank == 0 and cfg.sandbox is not None and with_sandbox:
        engines.append(sandbox_child(run))
    services = []
    if node_rank == 0:
        single = {"OMP_NUM_THREADS": "1"}
        services.append(
            Child(
                "router", job_command("engine.py", str(run.path), "--role", "router"), run.logs / "router.log", single
            )
        )
        orchestrator = dict(single)
        if cfg.sandbox is not None:  # env code finds the sandbox through the run directory
            orchestrator["MOLT_SANDBOX_RUN_DIR"] = str(run.path)
        services.append(
            Child("orchestrator", job_command("rollout.py", str(run.path)), run.logs / "rollout.log", orchestrator)
        )
    return engines, services


def check_pool_nodes(cfg: MoltConfig, nnodes: str | None) -> None:
    """Multi-node engines need exactly `count × nodes_per_engine` pool nodes (`SLURM_NNODES` of the step):
    one more or fewer would leave an engine without a part, or a part without an engine."""
    eng = cfg.engines
    want = eng.count * eng.nodes_per_engine
    if eng.nodes_per_engine > 1 and nnodes is not None and int(nnodes) != want:
        raise ValueError(
            f"the engine pool runs on {nnodes} nodes but engines.count × engines.nodes_per_engine = {want}: "
            f"set slurm.engines.nodes = {want}"
        )


def run_pool(cfg: MoltConfig, run: RunDir, node_rank: int, max_restarts: int, role: str = "pool") -> int:
    """Start and supervise this node's pool until SIGTERM (exit 0) or a fatal child death (exit 1). `role`:
    `pool` (all of it), `pool-no-sandbox` (het group 2 runs the sandbox), `sandboxes` (that group: the
    sandbox server alone)."""
    log = get_logger()
    if role == "sandboxes":
        engines, services = [sandbox_child(run)], []
    else:
        check_pool_nodes(cfg, os.environ.get("SLURM_NNODES"))
        engines, services = pool_children(cfg, run, node_rank, with_sandbox=role == "pool")
    children = engines + services
    # The router holds no state: restarted like an engine (the orchestrator follows it to its new port).
    restartable = engines + [c for c in services if c.name == "router"]
    finishing = [c for c in services if c.name != "router"]
    stopping = False

    def on_term(signum, _frame):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    for child in children:
        child.start()
        log.info("started %s (pid %d, log %s)", child.name, child.pid, child.log)
    try:
        while True:
            time.sleep(0.1)  # a stop's signal does not cut a sleep short: a short one ends the run sooner
            if stopping:  # children that exit now are answering the same stop, not dying
                return 0
            for child in restartable:
                code = child.poll()
                if code is None or stopping:  # (a stop that came with this exit is still a stop)
                    continue
                if not restart(child, code, max_restarts, run):
                    return 1
            for child in list(finishing):
                code = child.poll()
                if code is None:
                    continue
                if code:
                    log.error("%s exited (code %s); stopping the pool\n%s", child.name, code, child.tail())
                    return 1
                # A clean end (training done or a stop asked): engines keep serving until the launcher stops us.
                log.info("%s finished", child.name)
                finishing.remove(child)
    finally:
        codes = stop_all(children)
        failed = {n: c for n, c in codes.items() if c not in (0, None)}
        (log.warning if failed else log.info)("pool stopped: %s", exit_report(codes))


def restart(child: Child, code: int, max_restarts: int, run: RunDir) -> bool:
    """Start `child` again after it died; False (the cause recorded for the run) once it used its restarts."""
    log = get_logger()
    if child.restarts >= max_restarts:
        last = next((ln for ln in reversed(child.tail(5).splitlines()) if ln.strip()), "(no output)")
        reason = (
            f"{child.name} died {child.restarts + 1} times (engines.max_restarts = {max_restarts}); "
            f"last line of {child.log.name}: {last.strip()}"
        )
        log.error("%s; giving up\n%s", reason, child.tail())
        fail(run.path, reason, "engine pool")
        return False
    child.restarts += 1
    log.warning("%s died (exit %s); restarting it (%d/%d)", child.name, code, child.restarts, max_restarts)
    child.start()
    return True
