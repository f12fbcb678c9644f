"""Bytes that one token leaves saved for backward in each part of an HF decoder model.

Each term counts a tensor autograd keeps for the transformers code the trainer runs (Llama/Qwen
layout: RMSNorm, attention through SDPA or flash attention, SwiGLU MLP, MoE experts), with `c`
the compute dtype's bytes (bf16: 2):

- RMSNorm keeps its fp32 up-cast input (4h), the normalised input to the weight multiply (c·h) and
  one fp32 rsqrt: `(4 + c)·h + 4`, twice per block;
- attention keeps its projections' input (c·h), q, k, v as the kernel sees them (k and v repeated
  to every head when a mask forces SDPA off its grouped-query path), the output (c per element, the
  same tensor o_proj keeps) and the fp32 log-sum-exp per head; Qwen3's per-head q and k norms keep
  what an RMSNorm keeps;
- the MLP keeps its input (c·h) and four I-wide tensors (gate, up, silu(gate), their product);
- an MoE block keeps the fp32 router softmax, and per routed copy of the token (top-k of them) its
  gathered input, four expert-I-wide tensors and its output; a shared expert counts as an MLP.

The CPU trace test (tests/test_plan_trace.py) checks these against torch's memory tracker on real
transformers models; with activation checkpointing a block keeps only its input (c·h).
"""

from molt_hpc.plan.arch import Arch, Block


def norm_bytes(arch: Arch, c: int) -> int:
    return (4 + c) * arch.hidden + 4


def attention_bytes(arch: Arch, c: int, kv_repeat: bool, eager_seq: int = 0) -> int:
    """`eager_seq`: the row length when attention is `eager`, which keeps its scores and softmax."""
    h, heads = arch.hidden, arch.heads
    scores = 2 * c * heads * eager_seq
    if arch.mla:  # q and kv through their low-rank projections and norms, then full-width q, k, v
        q_dim = arch.qk_nope_head_dim + arch.qk_rope_head_dim
        lowrank = (4 + 2 * c) * (arch.q_lora_rank + arch.kv_lora_rank)
        return c * h + lowrank + c * heads * (2 * q_dim + 2 * arch.v_head_dim) + 4 * heads + scores
    kv_heads = heads if kv_repeat else arch.kv_heads
    qk_norm = (4 + c) * (heads + arch.kv_heads) * arch.head_dim + 4 * (heads + arch.kv_heads) if arch.qk_norm else 0
    return c * h + c * heads * arch.head_dim * 2 + 2 * c * kv_heads * arch.head_dim + 4 * heads + qk_norm + scores


def mlp_bytes(arch: Arch, block: Block, c: int) -> int:
    h = arch.hidden
    if not block.moe:
        return c * h + 4 * c * arch.intermediate
    routed = arch.top_k * (2 * c * h + 4 * c * arch.moe_intermediate)
    shared = 4 * c * arch.shared_intermediate
    return c * h + 4 * arch.experts + routed + shared


def block_bytes(arch: Arch, block: Block, c: int, kv_repeat: bool, eager_seq: int = 0) -> int:
    """Bytes one token leaves saved in one decoder block without activation checkpointing."""
    return 2 * norm_bytes(arch, c) + attention_bytes(arch, c, kv_repeat, eager_seq) + mlp_bytes(arch, block, c)


def mlp_width(arch: Arch, block: Block) -> int:
    """Intermediate width one token goes through in `block`'s MLP (all routed copies and the shared expert)."""
    if not block.moe:
        return arch.intermediate
    return arch.top_k * arch.moe_intermediate + arch.shared_intermediate


def head_bytes(arch: Arch, c: int) -> int:
    """The final norm and the LM head's input, per token (the logits are counted with the log-probs)."""
    return norm_bytes(arch, c) + c * arch.hidden
