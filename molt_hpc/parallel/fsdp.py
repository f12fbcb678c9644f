"""FSDP2 over a plain transformers model: `fully_shard` on every decoder block, then on the root; and
attention confined to packed samples, split over a CP group (`molt_hpc.parallel.attention`,
`molt_hpc.parallel.context`) when asked.

The model code stays untouched (no wrapper modules), so parameter names stay the HF names that
checkpoints and refits use. The same function shards the policy, the frozen reference and the critic.
Under `actor.offload = "full"` every `fully_shard` call gets FSDP2's CPU offload policy (it must
be on all of them): sharded parameters, gradients and optimizer state then live in host memory.
"""

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from molt_hpc.config.train import ActorConfig
from molt_hpc.models.blocks import decoder_blocks
from molt_hpc.models.router_replay import ReplayRouter
from molt_hpc.parallel.attention import DocumentAttention, use_document_attention
from molt_hpc.parallel.expert import apply_expert_parallel


def parallelize(
    model: nn.Module,
    mesh: DeviceMesh,
    cfg: ActorConfig,
    *,
    compute_dtype: torch.dtype = torch.float32,
    documents: DocumentAttention | None = None,
) -> nn.Module:
    """Shard `model` over `mesh` in place and return it.

    Parameters keep their dtype (fp32 master weights for trained models); forward and backward run in
    `compute_dtype`, with gradients reduced in fp32. With `documents` (packing, or `actor.cp > 1`: its
    `cp` group), the model attends within each sample of a row and splits rows over the CP group.
    Works on a meta-device model too (sharded loading materialises it afterwards).
    """
    assert cfg.cp == 1 or (documents is not None and documents.cp is not None), "actor.cp > 1 needs its CP group"
    if documents is not None:
        use_document_attention(model, documents)
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
    offload = offload_policy(cfg, mesh.device_type)
    shard_routers(model, mesh, offload)  # swapped MoE routers: their own fp32 units, before their blocks
    if cfg.ep > 1:  # experts first: their own FSDP units, inside their blocks' (expert.py)
        apply_expert_parallel(model, cfg.ep, cfg.ep_dispatch, mp, device_type=mesh.device_type, offload=offload)
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp, offload_policy=offload)
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=offload)
    return model


def offload_policy(cfg: ActorConfig, device_type: str) -> OffloadPolicy:
    """FSDP2's CPU offload under `actor.offload = "full"` (pinned host memory on GPUs), else none."""
    if cfg.offload == "full":
        return CPUOffloadPolicy(pin_memory=device_type == "cuda")
    return OffloadPolicy()


def shard_routers(model: nn.Module, mesh, offload_policy=None) -> None:
    """Make each swapped router its own FSDP unit with fp32 parameters (call before sharding its block;
    `offload_policy` is the blocks' own).

    Inputs are not cast: the router casts them itself, so its outputs (the top-k weights) keep the
    block's dtype."""
    fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32, cast_forward_inputs=False)
    for module in model.modules():
        if isinstance(module, ReplayRouter):
            fully_shard(module, mesh=mesh, mp_policy=fp32, offload_policy=offload_policy or OffloadPolicy())
