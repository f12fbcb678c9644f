"""An extra engine pool as a Slurm job of its own (`molt-hpc engines add RUN` without `--local`).

A plain job (no het group) submitted through submitit: its task on every node starts the pool's
supervisor there (`jobs/engine.py RUN_DIR --role extra-pool --pool NAME`), whose engines
register in the run directory like the run's own. Its settings default to the run's `[slurm]` and
`[slurm.engines]`. Preemption, requeue, the time limit and cancellation all reach the supervisor as
SIGTERM: its engines end their requests as `abort` with their tokens and the run's other engines
continue them; a requeued job starts the pool again and its engines rejoin after the trainer's refit.
Slurm's warning signal (`slurm.signal_lead_s` before the time limit) makes the pool leave the ring
first (`extra_pool.leave_ring`). The job is never requeued for its time limit: it ends as TIMEOUT.
"""

import shlex
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import submitit

from molt_hpc.config import MoltConfig
from molt_hpc.config.infra import slurm_time_seconds
from molt_hpc.launch.extra_pool import WARNING_SIGNAL
from molt_hpc.launch.procs import REPO


@dataclass(frozen=True)
class PoolJob:
    """What each of the job's tasks (one per node, started by submitit's srun) runs: the pool's supervisor
    for this node, in the task's process group, so Slurm's signals reach it."""

    run_dir: str
    name: str
    config: str

    def __call__(self) -> int:
        # The warning signal is the supervisor's to act on (it reaches every process of the step). Ignored
        # here, submitit's handler for it never runs: it would requeue the job, or at the time limit raise
        # and SIGKILL the supervisor, whose engines then die without handing on their requests. (Ignored,
        # not masked: a mask holds for one thread, and a signal taken by another still runs the handler.)
        # The supervisor inherits this until its own handler is in place.
        signal.signal(WARNING_SIGNAL, signal.SIG_IGN)
        cmd = [sys.executable, str(REPO / "jobs" / "engine.py"), self.run_dir, "--role", "extra-pool",
               "--pool", self.name, "--config", self.config]  # fmt: skip
        return subprocess.run(cmd, check=False).returncode


@dataclass(frozen=True)
class SlurmPoolSpec:
    """The pool job's allocation (None: the run's own setting)."""

    partition: str | None = None
    qos: str | None = None
    time: str | None = None
    gpus_per_node: int | None = None
    nodes: int = 1


def executor(cfg: MoltConfig, folder: Path, spec: SlurmPoolSpec) -> submitit.SlurmExecutor:
    """submitit's executor with the pool's parameters: the run's `[slurm.engines]` unless overridden."""
    group = cfg.slurm.engines
    ex = submitit.SlurmExecutor(folder, python=shlex.quote(sys.executable))
    params = {
        "job_name": f"{cfg.slurm.job_name}-pool",
        "nodes": spec.nodes,
        "ntasks_per_node": 1,
        "time": -(-slurm_time_seconds(spec.time or cfg.slurm.time) // 60),
        "signal_delay_s": cfg.slurm.signal_lead_s,
    }
    partition = spec.partition or group.partition
    if partition:
        params["partition"] = partition
    if spec.qos or group.qos:
        params["qos"] = spec.qos or group.qos
    gpus = spec.gpus_per_node if spec.gpus_per_node is not None else group.gpus_per_node
    if gpus:
        params["gpus_per_node"] = gpus
    params["cpus_per_task"] = group.cpus_per_task
    if group.mem:
        params["mem"] = group.mem
    # The warning the supervisor acts on, whatever signal submitit's environment would pick.
    warning = f"{WARNING_SIGNAL.name.removeprefix('SIG')}@{cfg.slurm.signal_lead_s}"
    extra = {"requeue": True, "signal": warning, **({"account": group.account} if group.account else {})}
    if group.constraint:
        extra["constraint"] = group.constraint
    ex.update_parameters(**params, additional_parameters=extra)
    return ex


def submit_pool(cfg: MoltConfig, run_dir: Path, name: str, config: Path, spec: SlurmPoolSpec) -> str:
    """Submit the pool's job; its job id."""
    job = executor(cfg, run_dir / "pools" / f"{name}-submitit", spec).submit(PoolJob(str(run_dir), name, str(config)))
    return str(job.job_id)


def dry_run(cfg: MoltConfig, run_dir: Path, name: str, spec: SlurmPoolSpec) -> str:
    """The batch script `submit_pool` would hand to sbatch; creates nothing."""
    ex = executor(cfg, run_dir / "pools" / f"{name}-submitit", spec)
    return ex._make_submission_file_text("<submitit runs the pool's supervisor>", "%j")


def slurm_state(job_id: str | None) -> str | None:
    """The job's state as `squeue` reports it; None once Slurm no longer lists it."""
    if not job_id:
        return None
    out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True, check=False)
    lines = out.stdout.split()
    return lines[0] if out.returncode == 0 and lines else None


def cancel(job_id: str | None) -> None:
    if job_id:
        subprocess.run(["scancel", job_id], capture_output=True, check=False)
