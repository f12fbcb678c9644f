"""`molt-hpc plan`: does a config fit, on paper, before anything runs or queues.

- `arch`: the model's shape and exact parameter counts from its config on the meta device;
- `activations`: bytes per token each part of an HF decoder keeps for backward;
- `shape`: what one trainer rank processes (rows, tokens, micro-batches) from the config;
- `trainer`: per-GPU trainer memory by category and by phase of a step;
- `engine`: engine memory and KV-cache capacity, refit bytes and time;
- `verdict`: placement, host memory, the checks against the hardware, blockers;
- `suggest`: ranked changes with their re-planned effect; `render`: the report and the one-line verdict.
"""

from molt_hpc.config import MoltConfig
from molt_hpc.plan.arch import arch_of
from molt_hpc.plan.render import report, verdict_line
from molt_hpc.plan.suggest import Suggestion, suggest
from molt_hpc.plan.verdict import Plan, make_plan

__all__ = ["Plan", "Suggestion", "default_local", "plan_config", "report", "verdict_line"]


def default_local(cfg: MoltConfig) -> bool:
    """Plan this machine's placement (`molt-hpc run`) unless the Slurm section asks for GPUs."""
    return not (cfg.slurm.actor.gpus_per_node or cfg.slurm.engines.gpus_per_node)


def plan_config(cfg: MoltConfig, *, local: bool, gpus: int | None = None) -> tuple[Plan, list[Suggestion]]:
    """The plan of `cfg` and, when it does not fit, the ranked changes that would help."""
    arch = arch_of(cfg.model)
    plan = make_plan(cfg, arch, local=local, gpus=gpus)
    return plan, suggest(plan, local=local, gpus=gpus)
