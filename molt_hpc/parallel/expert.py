"""Expert parallelism (`actor.ep > 1`): each MoE layer's experts sharded over the EP ranks of a node,
tokens moved to their experts' ranks and back by all-to-all.

The world is viewed as a 2-D mesh `(efsdp, ep)`, row-major, so an EP group is `ep` consecutive ranks
(one node, since `ep` divides the ranks per node). Every expert parameter (`[E, ...]`, transformers
5's fused 3-D layout) becomes a DTensor `Shard(0)` over `ep` (rank j of a group holds experts
`j·E/ep ... (j+1)·E/ep - 1`) and is FSDP-sharded over `efsdp`; everything else stays FSDP over all
ranks. The model code is untouched: the experts' forward is a registered transformers experts
implementation (`ExpertsInterface`, chosen with `set_experts_implementation`), which receives each
rank's own tokens with their router's top-k (live or replayed: routing happens before dispatch, so
router replay needs nothing here), sends each (token, expert) pair to the expert's rank, runs the local
experts as one grouped GEMM and sends the results back; the router weights multiply on the token's
own rank, so the router's gradient stays local.

Gradient scale: the trainer multiplies each rank's loss by the world size and FSDP averages over a
unit's mesh. An expert's gradient already sums the tokens of its `ep` peers (the all-to-all's
backward) before FSDP averages it over `efsdp`, so it would come out ×ep; the local expert weights
pass through `scale_grad(1/ep)` in the forward. (FSDP's own `set_gradient_divide_factor` would do the
same, but its single-rank path divides twice when sum-only reductions are forced, as gloo needs.)
"""

import functools
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from molt_hpc.log import get_logger
from molt_hpc.parallel.ep_check import check_ep, num_experts
from molt_hpc.parallel.local_experts import EPGroup, local_experts_mlp
from molt_hpc.refit.experts import experts_modules

IMPLEMENTATIONS = {"all_to_all": "molt_ep_all_to_all", "deep_ep": "molt_ep_deep_ep"}
"""`actor.ep_dispatch` → the name registered in transformers' `ExpertsInterface`."""


@functools.cache
def ep_mesh(device_type: str, world: int, ep: int) -> DeviceMesh:
    """The `(efsdp, ep)` mesh over all ranks (one per process: its groups serve every model)."""
    return init_device_mesh(device_type, (world // ep, ep), mesh_dim_names=("efsdp", "ep"))


def shard_experts(module: nn.Module, mesh: DeviceMesh) -> None:
    """Replace each `[E, ...]` parameter of an experts module by its `Shard(0)` DTensor over `mesh["ep"]`."""
    ep_mesh_1d = mesh["ep"]
    ep = ep_mesh_1d.size()
    for name, p in list(module.named_parameters(recurse=False)):
        assert p.shape[0] == module.num_experts, f"{name}: expected [num_experts, ...], got {list(p.shape)}"
        sharded = nn.Parameter(distribute_tensor(p.detach(), ep_mesh_1d, [Shard(0)]), requires_grad=p.requires_grad)
        setattr(module, name, sharded)
    module._molt_ep = EPGroup(ep_mesh_1d.get_group(), ep, ep_mesh_1d.get_local_rank())


def apply_expert_parallel(
    model: nn.Module,
    ep: int,
    dispatch: str,
    mp: MixedPrecisionPolicy,
    *,
    device_type: str,
    offload: OffloadPolicy | None = None,
    check: bool = True,
) -> list[nn.Module]:
    """Shard `model`'s experts over EP groups of `ep` ranks and give each expert module its own FSDP unit
    over the rest (call before `fully_shard` of the blocks); returns the expert units."""
    world = dist.get_world_size()
    experts = experts_modules(model)
    if check:  # torchrun's LOCAL_WORLD_SIZE: the ranks of this node
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        check_ep(ep, world, per_node, num_experts(model.config.to_dict()) if experts else None)
    if dispatch == "deep_ep" and mp.param_dtype != torch.bfloat16:
        raise ValueError("actor.ep_dispatch = 'deep_ep' moves bf16 activations: set model.dtype = 'bfloat16'")
    register(dispatch)
    mesh = ep_mesh(device_type, world, ep)  # the world mesh's type: the model may be on the meta device
    for module in experts:
        shard_experts(module, mesh)
        fully_shard(module, mesh=mesh["efsdp"], mp_policy=mp, offload_policy=offload or OffloadPolicy())
    model.set_experts_implementation(IMPLEMENTATIONS[dispatch])
    get_logger().info(
        "expert parallel: %d MoE layers' experts over EP groups of %d (FSDP over %d), dispatch %s",
        len(experts), ep, world // ep, dispatch,
    )  # fmt: skip
    return experts


def register(dispatch: str) -> None:
    """Register the experts implementation of `dispatch` with transformers (idempotent)."""
    from transformers.integrations.moe import ExpertsInterface

    if dispatch not in IMPLEMENTATIONS:
        raise ValueError(f"actor.ep_dispatch = {dispatch!r}: choose one of {', '.join(IMPLEMENTATIONS)}")
    if dispatch == "deep_ep":
        from molt_hpc.parallel.deepep import deep_ep_forward, require_deep_ep

        require_deep_ep()
        ExpertsInterface.register(IMPLEMENTATIONS[dispatch], deep_ep_forward)
    else:
        ExpertsInterface.register(IMPLEMENTATIONS[dispatch], all_to_all_forward)


def exchange_counts(counts: torch.Tensor, ctx: EPGroup) -> torch.Tensor:
    """Pairs this rank gets from each peer for each of its local experts, `[ep, E/ep]`, from the pairs it
    sends to each expert (`counts [E]`)."""
    recv = torch.empty_like(counts)
    dist.all_to_all_single(recv, counts, group=ctx.group)
    return recv.view(ctx.size, -1)


def all_to_all_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """The experts of an EP-sharded experts module on this rank's tokens (`[T, H]`, global top-k ids)."""
    ctx: EPGroup = self._molt_ep
    k = top_k_index.shape[1]
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert, hence by the expert's rank
    counts = torch.bincount(flat, minlength=self.num_experts)
    recv_counts = exchange_counts(counts, ctx)
    send_splits = counts.view(ctx.size, -1).sum(1).tolist()  # one host sync per layer: split sizes
    recv_splits = recv_counts.sum(1).tolist()
    recv = all_to_all_single_autograd(hidden_states[order // k], recv_splits, send_splits, ctx.group)
    # Received rows come by source rank, then by local expert: regroup them by local expert.
    experts_local = recv_counts.shape[1]
    local_ids = torch.repeat_interleave(
        torch.arange(experts_local, device=flat.device).repeat(ctx.size), recv_counts.reshape(-1)
    )
    perm = torch.argsort(local_ids, stable=True)
    y = local_experts_mlp(self, recv[perm], local_ids[perm], recv_counts.sum(0))
    back = all_to_all_single_autograd(y[_inverse(perm)], send_splits, recv_splits, ctx.group)
    return combine(back, order, top_k_weights, hidden_states.dtype)


def combine(pair_out: torch.Tensor, order: torch.Tensor, top_k_weights: torch.Tensor, dtype) -> torch.Tensor:
    """Each token's output: its K pairs' outputs (rows in `order`) weighted by the router and summed, in the
    same order of operations as transformers' grouped_mm path."""
    tokens, k = top_k_weights.shape
    pairs = pair_out[_inverse(order)] * top_k_weights.reshape(-1, 1)
    return pairs.view(tokens, k, -1).sum(dim=1).to(dtype)


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv


def clip_grad_norm(params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """`clip_grad_norm_` over parameters on several meshes (experts on `(efsdp, ep)`, the rest on the world
    mesh), where torch's refuses to mix meshes. Every gradient element lives on exactly one rank (FSDP and
    EP only shard), so the squared norm is one sum over the world of each rank's local squares."""
    grads = [local_grad(p) for p in params if p.grad is not None]
    square = torch.zeros((), dtype=torch.float32, device=grads[0].device if grads else None)
    for g in grads:
        square += g.float().square().sum()
    dist.all_reduce(square)
    total = square.sqrt()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    if grads:
        torch._foreach_mul_(grads, coef.to(grads[0].dtype))
    return total


def local_grad(p: nn.Parameter) -> torch.Tensor:
    g = p.grad
    if isinstance(g, DTensor):
        assert not any(pl.is_replicate() or pl.is_partial() for pl in g.placements), f"not sharded: {g.placements}"
        return g.to_local()
    return g


def on_several_meshes(params: list[nn.Parameter]) -> bool:
    meshes = {p.device_mesh for p in params if isinstance(p, DTensor)}
    return len(meshes) > 1
