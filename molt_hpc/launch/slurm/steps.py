"""The job steps the driver starts inside the heterogeneous allocation, and their rendezvous.

Het group 0: `srun --het-group=0 … torchrun … ACTOR_SCRIPT RUN_DIR`, one torchrun per node whose c10d
rendezvous (MASTER_ADDR:PORT) sits on the group's first node. Het group 1: `srun --het-group=1 …
python ENGINE_SCRIPT RUN_DIR --role pool`, one engine pool per node; it finds everything else
through the run directory. With `[sandbox]`, het group 2: `srun --het-group=2 … python ENGINE_SCRIPT
RUN_DIR --role sandboxes`, the sandbox server on a CPU node, supervised there and watched by the driver
together with the engine pool (`PoolSteps`). Node lists come from the het job's environment; addresses from
`scontrol show node` (a node's name need not resolve, its NodeAddr does).
"""

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from molt_hpc.config import MoltConfig
from molt_hpc.config.infra import SlurmGroupConfig
from molt_hpc.launch.procs import REPO, Child
from molt_hpc.net import free_port

ACTOR_STEP = "molt-actor-pool"
POOL_STEP = "molt-engine-pool"
SANDBOX_STEP = "molt-sandbox"


def het_nodes(index: int) -> list[str]:
    """Hostnames of het group `index` of the job this process runs in."""
    key = f"SLURM_JOB_NODELIST_HET_GROUP_{index}"
    nodelist = os.environ.get(key)
    if not nodelist:
        raise ValueError(
            f"{key} is not set: the driver must run in the batch script of a heterogeneous job with two "
            "groups (submit with `molt-hpc submit`, or the script `molt-hpc sbatch` writes)"
        )
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True)
    return out.stdout.split()


def node_addr(node: str) -> str:
    """The address other nodes reach `node` at: its Slurm NodeAddr (the name itself by default)."""
    out = subprocess.run(["scontrol", "-o", "show", "node", node], capture_output=True, text=True)
    for token in out.stdout.split():
        key, _, value = token.partition("=")
        if key == "NodeAddr" and value:
            return value
    return node


def script_path(path: str) -> str:
    p = Path(path)
    return str(p if p.is_absolute() else REPO / p)


@dataclass
class SrunStep(Child):
    """A job step run by srun. srun answers SIGTERM by killing its tasks, so a graceful stop sends
    `stop_signal` to the step's tasks through `scancel --signal` and kills srun only after `grace_s`."""

    step_name: str = ""
    stop_signal: str = "TERM"
    """The engine pool takes SIGINT: every process of it answers INT as a stop, as TERM, and slurmstepd
    logs a step sent TERM as CANCELLED even when it exits 0 after a clean stop."""

    def step_ids(self) -> list[str]:
        jobs = ",".join(v for k, v in os.environ.items() if k.startswith("SLURM_JOB_ID_HET_GROUP_"))
        out = subprocess.run(["squeue", "-h", "-s", "-j", jobs, "-o", "%i %j"], capture_output=True, text=True)
        return [line.split()[0] for line in out.stdout.splitlines() if line.split()[1:] == [self.step_name]]

    def stop(self, grace_s: float = 10.0) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.poll()
        for step_id in self.step_ids():
            subprocess.run(["scancel", f"--signal={self.stop_signal}", step_id], capture_output=True)
        try:
            return self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            return super().stop(grace_s)


def srun_prefix(index: int, group: SlurmGroupConfig, nodes: int, name: str) -> list[str]:
    """One task per node of het group `index`, in a step called `name`; a failing task ends the step."""
    cmd = ["srun", f"--het-group={index}", f"--job-name={name}", f"--nodes={nodes}", "--ntasks-per-node=1"]
    cmd += [f"--cpus-per-task={group.cpus_per_task}", "--kill-on-bad-exit=1", "--unbuffered"]
    if group.gpus_per_node:
        cmd.append(f"--gpus-per-node={group.gpus_per_node}")
    return cmd


def procs_per_node(cfg: MoltConfig) -> int:
    """Trainer ranks per actor node: one per GPU; on CPU nodes `actor.ranks` spread over the nodes."""
    gpus = cfg.slurm.actor.gpus_per_node
    return gpus if gpus else max(1, cfg.actor.ranks // cfg.slurm.actor.nodes)


def actor_command(cfg: MoltConfig, run_dir: Path, nodes: list[str], endpoint: str, job_id: str) -> list[str]:
    torchrun = [
        sys.executable, "-m", "molt_hpc.launch.torchrun",
        f"--nnodes={len(nodes)}", f"--nproc-per-node={procs_per_node(cfg)}",
        "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id=molt-{job_id}", "--max-restarts=0",
        script_path(cfg.slurm.actor_script), str(run_dir),
    ]  # fmt: skip
    return srun_prefix(0, cfg.slurm.actor, len(nodes), ACTOR_STEP) + torchrun


def engine_command(cfg: MoltConfig, run_dir: Path, nodes: list[str]) -> list[str]:
    pool = [sys.executable, "-u", script_path(cfg.slurm.engine_script), str(run_dir), "--role", "pool"]
    if cfg.sandbox is not None:  # het group 2 runs it
        pool.append("--no-sandbox")
    return srun_prefix(1, cfg.slurm.engines, len(nodes), POOL_STEP) + pool


def sandbox_command(cfg: MoltConfig, run_dir: Path) -> list[str]:
    server = [sys.executable, "-u", script_path(cfg.slurm.engine_script), str(run_dir), "--role", "sandboxes"]
    return srun_prefix(2, cfg.slurm.sandboxes, 1, SANDBOX_STEP) + server


class PoolSteps:
    """The engine pool's step and, with `[sandbox]`, the sandbox server's: the driver watches, relaunches
    and stops them as one pool (a dead one is relaunched alone)."""

    def __init__(self, steps: list[SrunStep]):
        self.steps, self.restarts, self.name = steps, 0, steps[0].name
        self.cmd, self.log = steps[0].cmd, steps[0].log

    def start(self) -> None:
        for step in self.steps:
            if step.proc is None or step.proc.poll() is not None:
                step.start()

    def poll(self) -> int | None:
        """The exit code of a step that ended (a failure first), None while all run."""
        ended = [(step, code) for step in self.steps if (code := step.poll()) is not None]
        if not ended:
            return None
        step, code = max(ended, key=lambda sc: sc[1] != 0)
        self.log = step.log
        return code

    def tail(self, lines: int = 20) -> str:
        return (
            self.steps[0].tail(lines)
            if len(self.steps) == 1
            else "\n".join(f"[{step.name}]\n{step.tail(lines)}" for step in self.steps)
        )

    def stop(self, grace_s: float = 10.0) -> None:
        for step in self.steps:
            step.stop(grace_s)


def job_steps(cfg: MoltConfig, run_dir: Path, job_id: str) -> tuple[SrunStep, PoolSteps]:
    """(actor pool, engine pool with the sandbox) steps of this allocation, not started yet; logs in `logs/`."""
    actor_nodes, engine_nodes = het_nodes(0), het_nodes(1)
    endpoint = f"{node_addr(actor_nodes[0])}:{free_port()}"
    logs = run_dir / "logs"
    actor_cmd = actor_command(cfg, run_dir, actor_nodes, endpoint, job_id)
    actor = SrunStep("actor pool", actor_cmd, logs / "actor.log", step_name=ACTOR_STEP)
    pool_cmd = engine_command(cfg, run_dir, engine_nodes)
    steps = [SrunStep("engine pool", pool_cmd, logs / "pool.log", step_name=POOL_STEP, stop_signal="INT")]
    if cfg.sandbox is not None:
        sandbox_cmd = sandbox_command(cfg, run_dir)
        steps.append(
            SrunStep("sandbox", sandbox_cmd, logs / "sandboxes.log", step_name=SANDBOX_STEP, stop_signal="INT")
        )
    return actor, PoolSteps(steps)
