"""FSDP2 over a plain transformers model: `fully_shard` on every decoder block, then on the root.

The model code stays untouched (no wrapper modules), so parameter names stay the HF names that
checkpoints and refits use. The same function shards the policy, the frozen reference and the critic.
"""

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from molt_hpc.actor.features import unbuilt
from molt_hpc.config.train import ActorConfig


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of an HF model: modules whose class its `_no_split_modules` names."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    return [m for m in model.modules() if type(m).__name__ in names]


def parallelize(
    model: nn.Module, mesh: DeviceMesh, cfg: ActorConfig, *, compute_dtype: torch.dtype = torch.float32
) -> nn.Module:
    """Shard `model` over `mesh` in place and return it.

    Parameters stay fp32 (the master weights); forward and backward run in `compute_dtype`, with
    gradients reduced in fp32.
    """
    missing = unbuilt(cfg)
    if missing:
        raise ValueError("; ".join(missing))
    blocks = decoder_blocks(model)
    if not blocks:
        raise ValueError(
            f"{type(model).__name__} names no decoder block class in _no_split_modules; FSDP2 sharding per "
            "block needs one (every transformers decoder model has it)"
        )
    trainable = any(p.requires_grad for p in model.parameters())
    if cfg.activation_checkpointing and trainable:
        # transformers' own checkpointing keeps module names (a wrapper module would rename parameters);
        # transformers 5 renamed the method.
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model
