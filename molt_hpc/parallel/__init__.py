"""How a trainer's model is laid out over the actor pool's GPUs: one entry point, `parallelize(model, mesh,
actor_cfg, ...)`, which applies FSDP2 and, as the config asks, document attention, context parallelism and
expert parallelism to a plain transformers model in place (the model code is never forked).

fsdp.py           `parallelize`: FSDP2 units (swapped MoE routers, EP experts, decoder blocks, the root), offload
attention.py      document attention: attention confined to each packed sample, a CP group's slices made whole
context.py        Ulysses context parallelism: each rank of a CP group runs a slice of every row
expert.py         expert parallelism: experts sharded over the EP ranks of a node, all-to-all dispatch
deepep.py         the DeepEP dispatch of expert parallelism (`actor.ep_dispatch = "deep_ep"`)
local_experts.py  the experts a rank holds, run as grouped GEMMs on the rows sent to them (both dispatches)
expert_gather.py  expert-parallel weights out of their shards for refits and checkpoints, one EP slice at a time
ep_check.py       whether an EP degree fits the world and the model (torch-free: launchers call it too)

`parallelize` is loaded on first use, so that launchers can read `ep_check` without importing torch.
"""

from typing import Any

__all__ = ["parallelize"]


def __getattr__(name: str) -> Any:
    if name == "parallelize":
        from molt_hpc.parallel.fsdp import parallelize

        return parallelize
    raise AttributeError(f"module 'molt_hpc.parallel' has no attribute {name!r}")
