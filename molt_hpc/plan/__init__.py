"""`molt-hpc plan`: does a config fit, on paper, before anything runs or queues.

- `arch`: the model's shape and exact parameter counts from its config on the meta device; `arch_types`:
  what the plan knows of a model (`Arch` and its per-block `Block`); `closed_form`: the parameter counts of
  the common decoder families from their config fields alone (no transformers, no torch);
- `lora`: how many adapter parameters `[actor.lora]` adds to a model of shape `Arch`;
- `activations`: bytes per token each part of an HF decoder keeps for backward;
- `shape`: what one trainer rank processes (rows, tokens, micro-batches) from the config;
- `trainer`: per-GPU trainer memory by category and by phase of a step; `logprobs`: the trainer's log-prob
  working sets (what is alive at each moment of `policy_logprobs` and its backward);
- `engine`: engine memory and KV-cache capacity, refit bytes and time; `extra`: what an extra engine pool
  (`molt-hpc engines add`) adds to a planned run;
- `speed`: the speed of one RL training step, predicted from the model's shape, the config and the hardware;
  `speed_text`: the speed block of the report, and predicted against measured for `molt-hpc status`;
  `step_split`: where a run's training steps spend their time, from its `metrics.jsonl` actor records;
- `calibrate`: `molt-hpc plan --calibrate`, this machine's speed profile measured; `calibrate_train`: the
  trainer's own step, timed for it; `calibrate_shared`: on a GPU, the engine's decoding beside a training process;
- `balance`: `molt-hpc plan --balance`, the engine:trainer GPU split and `rollout.groups_in_flight` that train
  the most tokens per second on the config's GPUs;
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
