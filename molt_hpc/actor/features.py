"""Which parallelism and memory features this trainer has built: the one switch the planner and
the trainer both read.

A config may ask for a feature before the trainer has it (the config tree describes the design);
the trainer refuses it at start-up and `molt-hpc plan` names it in its verdict, so nothing queues
on a cluster only to be refused there. Work that builds a feature flips its entry here.
"""

from molt_hpc.config.train import ActorConfig

BUILT: dict[str, bool] = {
    "cp": True,
    "ep": True,
    "offload": True,
    "sharded_load": True,
}
"""Feature → whether this trainer implements it. `sharded_load`: each rank reads only its shard of
the checkpoint (otherwise every rank holds the whole fp32 model in host memory while loading)."""


def unbuilt(cfg: ActorConfig) -> list[str]:
    """One line per feature `cfg` asks for that this trainer has not built (empty: it can run)."""
    out = []
    if cfg.cp > 1 and not BUILT["cp"]:
        out.append(f"actor.cp = {cfg.cp}: context parallelism is not built in this trainer yet (set actor.cp = 1)")
    if cfg.ep > 1 and not BUILT["ep"]:
        out.append(f"actor.ep = {cfg.ep}: expert parallelism is not built in this trainer yet (set actor.ep = 1)")
    if cfg.offload != "none" and not BUILT["offload"]:
        out.append(f"actor.offload = {cfg.offload!r}: CPU offload is not built in this trainer yet (set it to 'none')")
    return out
