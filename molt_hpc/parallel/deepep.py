"""DeepEP dispatch for expert parallelism (`actor.ep_dispatch = "deep_ep"`): the same experts
implementation as the all-to-all one, with DeepEP's intranode NVLink kernels moving the tokens.

DeepEP's "normal" (high-throughput) kernels send each token once to every rank that holds one of its
experts, with its top-k ids translated to that rank's local ids (−1 for experts elsewhere) and its
router weights; the receiver runs its experts on the (token, local expert) pairs, weights and sums
them per token, and `combine` adds the ranks' partial sums on the token's own rank. Backward:
dispatch's gradient is a combine (of the token gradients, and of the router weights' gradients, which
come home through combine's `topk_weights`), combine's is a dispatch with the same handle. Intranode
only (no RDMA, NVSHMEM not initialised), bf16 activations.

`deep_ep` has no wheel on PyPI: it must be built for the installed torch and CUDA (Hopper). Without it
`actor.ep_dispatch = "deep_ep"` stops with an error saying so.
"""

import functools

import torch
from torch import nn

from molt_hpc.parallel.local_experts import EPGroup, local_experts_mlp

WIRE_DTYPE = torch.bfloat16
"""What DeepEP's normal kernels move (they take bf16 tokens only)."""


def require_deep_ep():
    """The `deep_ep` module, or a `ValueError` saying how to get it."""
    try:
        import deep_ep
    except ImportError as err:
        raise ValueError(
            f"actor.ep_dispatch = 'deep_ep' but the deep_ep package does not import ({err}): build DeepEP for this "
            "torch and CUDA (it has no PyPI wheel; Hopper GPUs, NVLink) into this environment, or set "
            "actor.ep_dispatch = 'all_to_all'"
        ) from None
    if not torch.cuda.is_available():
        raise ValueError("actor.ep_dispatch = 'deep_ep' needs CUDA GPUs; use actor.ep_dispatch = 'all_to_all'")
    return deep_ep


@functools.cache
def buffer_for(group, hidden_bytes: int):
    """One DeepEP buffer per EP group, sized for `hidden_bytes` per token (DeepEP's own size hints)."""
    deep_ep = require_deep_ep()
    ranks = group.size()
    nvl = max(
        deep_ep.Buffer.get_dispatch_config(ranks).get_nvl_buffer_size_hint(hidden_bytes, ranks),
        deep_ep.Buffer.get_combine_config(ranks).get_nvl_buffer_size_hint(hidden_bytes, ranks),
    )
    return deep_ep.Buffer(group, num_nvl_bytes=nvl, num_rdma_bytes=0)


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_idx, topk_weights, buffer, num_experts):
        per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
        recv_x, recv_idx, recv_w, _, handle, _ = buffer.dispatch(
            x, topk_idx=topk_idx, topk_weights=topk_weights, num_tokens_per_rank=per_rank,
            is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
        )  # fmt: skip
        ctx.buffer, ctx.handle = buffer, handle
        ctx.mark_non_differentiable(recv_idx)
        return recv_x, recv_idx, recv_w, handle

    @staticmethod
    def backward(ctx, grad_x, _grad_idx, grad_w, _grad_handle):
        grad_w = torch.zeros_like(grad_w) if grad_w is None else grad_w.float()
        combined, combined_w, _ = ctx.buffer.combine(grad_x.contiguous(), ctx.handle, topk_weights=grad_w)
        return combined, None, combined_w, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, buffer, handle):
        ctx.buffer, ctx.handle = buffer, handle
        combined, _, _ = buffer.combine(y, handle)
        return combined

    @staticmethod
    def backward(ctx, grad):
        recv, _, _, _, _, _ = ctx.buffer.dispatch(grad.contiguous(), handle=ctx.handle)
        return recv, None, None


def deep_ep_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """The experts of an EP-sharded experts module on this rank's tokens, moved by DeepEP."""
    ctx: EPGroup = self._molt_ep
    x = hidden_states.to(WIRE_DTYPE).contiguous()
    buffer = buffer_for(ctx.group, x.shape[1] * x.element_size())
    recv_x, recv_idx, recv_w, handle = _Dispatch.apply(
        x, top_k_index.to(torch.int64).contiguous(), top_k_weights.float().contiguous(), buffer, self.num_experts
    )
    rows, slots = torch.nonzero(recv_idx >= 0, as_tuple=True)  # (received token, top-k slot) pairs here
    local_ids = recv_idx[rows, slots]
    order = torch.argsort(local_ids, stable=True)
    counts = torch.bincount(local_ids, minlength=self.num_experts // ctx.size)
    y = local_experts_mlp(self, recv_x[rows[order]], local_ids[order], counts)
    weighted = y * recv_w[rows[order], slots[order]].unsqueeze(-1).to(y.dtype)
    per_token = torch.zeros(recv_x.shape[0], y.shape[1], dtype=torch.float32, device=y.device)
    per_token = per_token.index_add(0, rows[order], weighted.float())
    return _Combine.apply(per_token.to(WIRE_DTYPE), buffer, handle).to(hidden_states.dtype)
