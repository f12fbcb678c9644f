"""Checks before a job is submitted: Slurm is reachable, and each het group fits its partition.

The partition limits come from `sinfo` (skipped when it is not on PATH); every failure is a
`ValueError` that says what to change, raised before anything is created.
"""

import re
import shutil
import subprocess
from dataclasses import dataclass

from molt_hpc.config import MoltConfig

GPU_GRES = re.compile(r"(?:^|,)gpu(?::[^:,(]+)?:(\d+)")


@dataclass(frozen=True)
class Partition:
    """What `sinfo` says about one partition (the largest node of each kind)."""

    name: str
    nodes: int
    cpus_per_node: int
    gpus_per_node: int
    default: bool


def gpus_in_gres(gres: str) -> int:
    """GPUs per node in an sinfo `%G` string such as `gpu:h100:8(S:0-1),nvme:1`; 0 for `(null)`."""
    return max((int(n) for n in GPU_GRES.findall(gres)), default=0)


def parse_sinfo(text: str) -> dict[str, Partition]:
    """Partitions from `sinfo -h -o '%P|%D|%c|%G'` lines (one line per partition and node kind)."""
    parts: dict[str, Partition] = {}
    for line in text.splitlines():
        if line.count("|") != 3:
            continue
        name, nodes, cpus, gres = line.strip().split("|")
        default = name.endswith("*")
        name = name.rstrip("*")
        old = parts.get(name)
        cpu_count = int(cpus.rstrip("+"))  # `%c` prints `64+` when node sizes differ
        parts[name] = Partition(
            name=name,
            nodes=int(nodes) + (old.nodes if old else 0),
            cpus_per_node=max(cpu_count, old.cpus_per_node if old else 0),
            gpus_per_node=max(gpus_in_gres(gres), old.gpus_per_node if old else 0),
            default=default or (old.default if old else False),
        )
    return parts


def read_partitions() -> dict[str, Partition] | None:
    """The cluster's partitions, or None when `sinfo` is missing or fails (nothing to check against)."""
    if shutil.which("sinfo") is None:
        return None
    out = subprocess.run(["sinfo", "-h", "-o", "%P|%D|%c|%G"], capture_output=True, text=True, timeout=60)
    return parse_sinfo(out.stdout) if out.returncode == 0 else None


def check_slurm_reachable() -> None:
    if shutil.which("sbatch") is None:
        raise ValueError(
            "sbatch is not on PATH: run `molt-hpc submit` on a Slurm login node (load the Slurm module "
            "first), or print the script with --dry-run, or write one with `molt-hpc sbatch CONFIG -o FILE`"
        )


def check_partitions(cfg: MoltConfig, partitions: dict[str, Partition]) -> None:
    """Each het group asks for no more nodes, CPUs or GPUs per node than its partition has."""
    sl = cfg.slurm
    default = next((p.name for p in partitions.values() if p.default), None)
    used: dict[str, int] = {}
    groups = [("actor", sl.actor), ("engines", sl.engines)] + ([("sandboxes", sl.sandboxes)] if cfg.sandbox else [])
    for key, group in groups:
        name = group.partition or default
        where = f"slurm.{key}.partition"
        if name is None:
            raise ValueError(f"{where} is unset and the cluster has no default partition: set it")
        part = partitions.get(name)
        if part is None:
            known = ", ".join(sorted(partitions)) or "none"
            raise ValueError(f"{where} = {name!r} is not a partition of this cluster (sinfo lists: {known})")
        if group.gpus_per_node > part.gpus_per_node:
            raise ValueError(
                f"slurm.{key}.gpus_per_node = {group.gpus_per_node} but the nodes of partition {name!r} have at "
                f"most {part.gpus_per_node} GPUs (sinfo): lower it and add nodes, or pick another partition"
            )
        if group.cpus_per_task > part.cpus_per_node:
            raise ValueError(
                f"slurm.{key}.cpus_per_task = {group.cpus_per_task} but the nodes of partition {name!r} have at "
                f"most {part.cpus_per_node} CPUs (sinfo): lower it"
            )
        used[name] = used.get(name, 0) + group.nodes
        if used[name] > part.nodes:
            raise ValueError(
                f"the job needs {used[name]} nodes of partition {name!r} (each het group its own nodes) but it "
                f"has {part.nodes} (sinfo): lower slurm.actor.nodes / slurm.engines.nodes or split the partitions"
            )


def check_actor_ranks(cfg: MoltConfig) -> None:
    """On CPU nodes `actor.ranks` trainer processes are spread evenly over the actor group's nodes."""
    nodes = cfg.slurm.actor.nodes
    if not cfg.slurm.actor.gpus_per_node and cfg.actor.ranks % nodes:
        raise ValueError(
            f"actor.ranks = {cfg.actor.ranks} does not spread evenly over slurm.actor.nodes = {nodes} CPU "
            "nodes: make it a multiple of the node count"
        )


def preflight(cfg: MoltConfig) -> None:
    """Everything that can be checked before submission; raises ValueError with the fix."""
    check_actor_ranks(cfg)
    check_slurm_reachable()
    partitions = read_partitions()
    if partitions is not None:
        check_partitions(cfg, partitions)
