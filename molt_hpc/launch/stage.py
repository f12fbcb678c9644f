"""Local mode of the supervised stages (`molt-hpc sft`, `molt-hpc rm train`): the actor pool alone.

One child, the one `molt-hpc run` starts for training (`torchrun … jobs/actor.py RUN_DIR`, which
runs the stage `run.stage` names); no engine pool. Ctrl-C / SIGTERM asks the trainer to checkpoint
at the next step boundary and exit (`control/stop`); a second Ctrl-C stops at once. At the end it
prints the stage's number (held-out loss or pair accuracy, first evaluation → last), where the
trained model is, and the plot.
"""

import json
import os

from molt_hpc.config import MoltConfig
from molt_hpc.launch.local import actor_child, child_died, gpu_env, prepare_run, visible_gpus
from molt_hpc.launch.procs import StopSignals
from molt_hpc.launch.progress import Progress
from molt_hpc.log import get_logger
from molt_hpc.records import stage_summary
from molt_hpc.rundir import atomic_write

COMMANDS = {"sft": "molt-hpc sft", "rm": "molt-hpc rm train", "rl": "molt-hpc run"}


def stage_threads(ranks: int) -> str:
    """Threads per trainer rank of a stage. Alone on the machine (no engine pool beside it), the ranks
    share every core they may use; `OMP_NUM_THREADS` in the environment says otherwise, for a machine
    shared with other work (more busy threads than cores can make each step several times slower)."""
    given = os.environ.get("OMP_NUM_THREADS", "").strip()
    if given.isdigit() and int(given) > 0:
        return given
    return str(max(1, len(os.sched_getaffinity(0)) // ranks))


def run_stage_local(cfg: MoltConfig) -> int:
    """Run (or continue) `cfg`'s SFT or reward-model run on this machine; the process exit code."""
    log = get_logger()
    run = prepare_run(cfg)
    log.info("run directory %s", run.path)
    actor = actor_child(cfg, run)
    actor.env["OMP_NUM_THREADS"] = stage_threads(cfg.actor.ranks)
    gpus = visible_gpus()
    if gpus:
        mine = [] if cfg.actor.device == "cpu" else gpus[: cfg.actor.ranks]
        actor.env.update(gpu_env(mine))
        log.info("GPUs: actor pool %s", mine or "none")
    actor.start()
    atomic_write(run.path / "processes.json", json.dumps({actor.name: actor.pid}))
    progress = Progress(cfg, run)
    stops = StopSignals(run.path)
    resume = f"{COMMANDS[cfg.run.stage]} --resume {run.path}"
    try:
        while (code := actor.wait(0.5)) is None:  # at once when the trainer exits
            progress.update()
        progress.update()
        if code == 0 and (run.path / "control" / "done").exists():
            for line in stage_summary(run.path, cfg.run.stage):
                print(line, flush=True)
            from molt_hpc.plot import plot_run

            print(f"plot: {plot_run(run.path)}", flush=True)
            return 0
        if code == 0 and stops.count:
            log.info("stopped after a checkpoint; continue with: %s", resume)
            return 0
        return child_died(actor, code, run)
    except KeyboardInterrupt:
        log.warning("stopped at once; resume from the last checkpoint with: %s", resume)
        return 130
    finally:
        actor.stop()
        progress.close()
        stops.restore()
