"""The slot runner's attention under `engines.exact`: decode steps and slot prefills that give a token the
same bits as the trainer's forward, so the exact engine decodes from the preallocated slot cache and, on a
GPU, replays CUDA graphs like the normal one.

A row's tokens sit at columns `0 .. length - 1` of its slot, token j at position j, so every query of a
slot forward attends to one run of keys that starts at column 0: a decode step's query to its row's
`position + 1` columns (the step's mask hides the rest of the attended width), a right-padded prefill's
query j to columns `0 .. j`. These functions take that run straight from the mask or the shape, with tensor
ops and no host sync (what a graph can record), and hand it to the kernel the trainer's exact attention
uses: on a GPU `models.exact_cuda_attention.attend`, which reads a query's keys in fixed blocks counted from
its first key whatever the attended width, where that kernel passed its check; elsewhere
`models.exact_attention.exact_attention` with the boolean mask, as the plain runner's exact forwards call it.
The functions are registered with transformers' `AttentionInterface` under their own names; the runner
switches the model to them for its slot forwards only (`engine.slots`, `engine.prefill`).
"""

import torch
from torch import Tensor

from molt_hpc.models.exact_attention import causal, exact_attention

DECODE = "molt_exact_slot_decode"
PREFILL = "molt_exact_slot_prefill"


def _fused(query: Tensor, key: Tensor) -> bool:
    if not query.is_cuda:
        return False
    from molt_hpc.models.exact_cuda_attention import usable

    return usable(query.shape[-1], query.shape[1], key.shape[1], query.dtype, query.device)


def exact_slot_decode(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """One query per row, `query [b, heads, 1, d]` over the slot cache's `[b, kv_heads, width, d]` under the
    step's additive mask `[b, 1, 1, width]` (0 where the row may look) -> `([b, 1, heads, d], None)`."""
    scale = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
    allowed = attention_mask[:, :, :, : key.shape[2]] == 0
    if _fused(query, key):
        from molt_hpc.models.exact_cuda_attention import attend

        count = allowed[:, 0].sum(-1, dtype=torch.int32)  # [b, 1]: the row's columns 0 .. position
        return attend(query, key, value, torch.zeros_like(count), count, scale), None
    return exact_attention(query, key, value, allowed, scale), None


def exact_slot_prefill(module, query, key, value, attention_mask=None, dropout=0.0, scaling=None, **kwargs):
    """Causal attention over right-padded rows (`[b, heads, L, d]`, K/V `[b, kv_heads, L, d]`): query j over
    columns `0 .. j`; a padding column's output is never read -> `([b, L, heads, d], None)`."""
    scale = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
    n = query.shape[2]
    if _fused(query, key):
        from molt_hpc.models.exact_cuda_attention import attend

        count = torch.arange(1, n + 1, dtype=torch.int32, device=query.device)[None]  # [1, L]
        return attend(query, key, value, torch.zeros_like(count), count, scale), None
    return exact_attention(query, key, value, causal(n, n, query.device), scale), None


def register() -> tuple[str, str]:
    """Register both functions with transformers; returns their (decode, prefill) names."""
    from transformers import AttentionInterface

    AttentionInterface.register(DECODE, exact_slot_decode)
    AttentionInterface.register(PREFILL, exact_slot_prefill)
    return DECODE, PREFILL
