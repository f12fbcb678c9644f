"""Trainer memory per GPU: persistent state by category, and the working set of each phase of a step.

The trainer keeps fp32 master weights sharded by FSDP2 over the actor pool's N GPUs (`4·P/N`), fp32
gradients (`4·P_trainable/N`, alive from the first backward of an update to its optimizer step) and
AdamW's two fp32 moments (`8·P_trainable/N`); the frozen reference adds `4·P/N`, a critic its own
16 bytes per parameter. `actor.offload` moves the moments (`optimizer`) or all three (`full`) to host;
under `optimizer` the moments are on the GPU again, whole, during the optimizer step.

Forward and backward run in the compute dtype (c bytes). FSDP2 keeps the root group (embeddings,
final norm, LM head) unsharded from forward through backward, gathers one decoder block at a time
(plus the next one it prefetches, in forward and in backward), reduces gradients in fp32 (the
reduce-scatter input of the block before stays alive while the next block's backward runs), and with
expert parallelism a block gathers only its own EP rank's experts. A block's backward peaks in the
SwiGLU product's backward. The log-probs go `actor.logprob_chunk` positions at a time
(`plan/logprobs.py`): with a plain linear LM head (`Arch.fused_head`, most models) from the last
hidden states and the head weight, so no `[n, V]` tensor exists — a chunk's logits and their fp32
temporaries, and in backward the head's fp32 gradient accumulator `[V, h]` with one `[V, h]` product
and its fp32 cast per chunk; other heads (soft-capping, logit scaling) through bf16 logits `[n, V]`
saved for backward and a logits-sized gradient.

The peak is the largest phase: the log-prob forward or backward (large vocabularies; the head
gradient's `[V, h]` terms where vocab × hidden is large against a chunk), a decoder block's backward
(long sequences), the root's reduce-scatter at the end of backward (huge vocab × hidden), the
optimizer step (foreach temporaries) or the reference forward. Numbers are what
`torch.cuda.max_memory_allocated` counts; `verdict.py` adds the CUDA context and allocator slack.

The supervised stages run the same trainer on their own rows (`shape.update_rows`): no reference, no
critic, and for a reward model no vocabulary log-probs (its head scores each position; its parameters
are counted as the causal LM's, head included: a little over what it holds).
"""

import dataclasses
from dataclasses import dataclass, field

import molt_hpc.plan.logprobs as logprobs
from molt_hpc.plan.activations import block_bytes, mlp_width
from molt_hpc.plan.arch import Arch
from molt_hpc.plan.shape import Shape

SWIGLU_GRADS = 2
"""What a block's backward adds to its saved activations at its peak, the backward of the SwiGLU product
`act(gate) * up`, in I-wide compute-dtype tensors per token: the gradients of the product, of act(gate)
and of up, less the product itself (the down projection's backward, just before, released it). That
backward's weight gradient is counted on its own."""
AC_GRAD_TRANSIENT = 2.6
"""The same with activation checkpointing, over the recomputed block's activations, its weight gradients
included: measured by the CPU trace (`tests/test_plan_trace.py`, the h512 spec with checkpointing)."""


def head_arch(arch: Arch, s: Shape) -> Arch:
    """The shape the log-prob terms see: a reward model's head has one output, not the vocabulary."""
    return arch if s.vocab_logits else dataclasses.replace(arch, vocab=1)


@dataclass
class Phase:
    """One moment of a step: its name and the bytes alive then, by part."""

    name: str
    parts: dict[str, float]

    @property
    def total(self) -> float:
        return sum(self.parts.values())


@dataclass
class TrainerMemory:
    """Per GPU: persistent state by category, activations and log-prob buffers, each phase, the peak."""

    state: dict[str, float]
    """Persistent bytes on the GPU by category (parameters, gradients, optimizer, reference, critic)."""
    host: dict[str, float]
    """Bytes this rank keeps in host memory (offloaded state)."""
    activations: dict[str, float]
    """Saved activations of one micro-batch: with and without checkpointing, and the log-prob buffers."""
    phases: list[Phase] = field(default_factory=list)

    @property
    def peak(self) -> Phase:
        return max(self.phases, key=lambda p: p.total)


def trainer_memory(arch: Arch, s: Shape) -> TrainerMemory:
    n, c = s.tokens, s.compute_bytes
    p_all = arch.params
    p_train = p_all - (arch.router_params if s.freeze_router else 0)
    state = {"parameters": 4 * p_all / s.ranks, "gradients": 4 * p_train / s.ranks,
             "optimizer": 8 * p_train / s.ranks}  # fmt: skip
    if s.lora:  # the base frozen in the compute dtype; fp32 adapters, their gradients and moments
        p_train = s.lora_params
        state = {"parameters": (c * p_all + 4 * p_train) / s.ranks, "gradients": 4 * p_train / s.ranks,
                 "optimizer": 8 * p_train / s.ranks}  # fmt: skip
    host = {}
    offloaded = {"none": (), "optimizer": ("optimizer",), "full": ("parameters", "gradients", "optimizer")}
    for key in offloaded[s.offload]:
        host[key] = state[key]
        state[key] = 0.0
    if s.reference and not s.lora:  # LoRA's reference is the policy with its adapters off
        state["reference"] = s.compute_bytes * p_all / s.ranks  # stored in model.dtype (it never trains)
    if s.critic:
        p_critic = p_all - (0 if arch.tied else arch.vocab * arch.hidden) + arch.hidden
        state["critic"] = 16 * p_critic / s.ranks
    per_token = sum(block_bytes(arch, b, c, s.kv_repeat, s.eager_seq) for b in arch.blocks)
    acts = {
        "activations (no checkpointing)": n * per_token,
        "activations (checkpointing)": n * c * arch.hidden * arch.layers,
        "log-prob buffers": logprobs.buffers(head_arch(arch, s), s),
    }
    mem = TrainerMemory(state=state, host=host, activations=acts)
    mem.phases = _phases(arch, s, state)
    return mem


def _phases(arch: Arch, s: Shape, state: dict[str, float]) -> list[Phase]:
    n, c, h = s.tokens, s.compute_bytes, arch.hidden
    head = head_arch(arch, s)
    grads = state["gradients"]
    resident = {k: x for k, x in state.items() if k != "gradients"}
    root = {"root group (unsharded)": c * arch.root_params}
    per_block = [n * block_bytes(arch, b, c, s.kv_repeat, s.eager_seq) for b in arch.blocks]
    kept = [n * c * h] * len(per_block) if s.ac else per_block
    saved = {"saved activations": sum(kept), **logprobs.saved(head, s)}
    fwd_grads = {"gradients": grads} if s.micro_batches > 1 else {}
    # the last block running (gathered) while the one FSDP prefetched for backward is gathered too
    two_blocks = {"blocks (unsharded)": 2 * c * _unsharded(arch, s, arch.blocks[-1]), **_ulysses(arch, s)}
    out = [
        Phase(
            "forward: last decoder block",
            {**resident, **fwd_grads, **root, **two_blocks, "saved activations": sum(kept[:-1]) + per_block[-1]},
        ),
        Phase("forward: log-probs", {**resident, **fwd_grads, **root, **saved, **logprobs.forward_chunk(head, s)}),
    ]
    out += [Phase(name, {**resident, **fwd_grads, **root, **saved, **parts})
            for name, parts in logprobs.backward_moments(head, s)]  # fmt: skip
    out += _block_backward(arch, s, resident, grads, root, kept, per_block)
    out.append(
        Phase(
            "backward: root reduce-scatter",
            {
                **resident,
                "gradients": grads,
                **root,
                "root gradients (unsharded)": 0.0 if s.lora else c * arch.root_params,  # LoRA: the root is frozen
                "reduce-scatter (fp32)": 0.0 if s.lora else 4 * arch.root_params,
            },
        )
    )
    trained = s.lora_params if s.lora else arch.params - arch.router_params
    opt = {"optimizer step temporaries": 0.0 if s.fused_adam else 4 * trained / s.ranks}
    if s.offload == "optimizer":  # the moments come back whole for the step (`actor/offload.py`), then leave
        opt["optimizer (on the GPU for the step)"] = 8 * trained / s.ranks
    out.append(Phase("optimizer step", {**resident, "gradients": grads, **opt}))
    if s.reference:
        out += _reference_forward(arch, s, resident)
    return out


def _unsharded(arch: Arch, s: Shape, block) -> float:
    """Parameters of `block` once FSDP gathered it (with EP: only this rank's experts)."""
    return block.params - block.experts * (1 - 1 / s.ep)


def _down_width(arch: Arch, s: Shape, block) -> int:
    """Input width of `block`'s down projection(s) on this rank: the MLP's, or this EP rank's experts' and
    the shared expert's (the weight gradient is `h` times it)."""
    if not block.moe:
        return arch.intermediate
    return arch.experts // s.ep * arch.moe_intermediate + arch.shared_intermediate


def _block_backward(arch, s, resident, grads, root, kept, per_block) -> list[Phase]:
    """The backward of the last block (all activations alive, the block before it prefetched) and of the
    first (the previous block's reduce-scatter buffer alive, with checkpointing a recomputed block)."""
    n, c, h = s.tokens, s.compute_bytes, arch.hidden
    out = []
    for i, name in ((len(per_block) - 1, "backward: last decoder block"), (0, "backward: first decoder block")):
        block = arch.blocks[i]
        p = _unsharded(arch, s, block)
        # the first micro-batch of an update has only the gradients of the blocks after i so far
        done = grads * sum(b.params for b in arch.blocks[i + 1 :]) / arch.params
        parts = {**resident, "gradients": grads if s.micro_batches > 1 else done, **root,
                 "LM head gradient": 0.0 if s.lora else c * arch.vocab * h,
                 "saved activations": sum(kept[:i]) + (per_block[i] if s.ac else kept[i]),
                 "block (unsharded)": c * p, "residual gradient": n * c * h}  # fmt: skip
        if s.ac:
            parts["activation gradients"] = AC_GRAD_TRANSIENT * n * c * mlp_width(arch, block)
        else:
            parts["activation gradients"] = SWIGLU_GRADS * n * c * mlp_width(arch, block)
            if not s.lora:  # a frozen base layer computes no weight gradient (its adapters' are tiny)
                parts["down projection weight gradient"] = c * h * _down_width(arch, s, block)
        if i > 0:  # FSDP2 prefetches the block whose backward comes next: its all-gather output
            parts["next block (prefetched)"] = c * _unsharded(arch, s, arch.blocks[i - 1])
        if i < len(per_block) - 1 and not s.lora:
            parts["reduce-scatter (fp32)"] = 4 * _unsharded(arch, s, arch.blocks[i + 1])
        parts.update(_ulysses(arch, s))
        out.append(Phase(name, parts))
    return out


def _ulysses(arch: Arch, s: Shape) -> dict[str, float]:
    """Context parallelism's all-to-all outputs of the running layer: q, k, v in, the output back."""
    if s.cp == 1:
        return {}
    width = 2 * arch.heads * arch.head_dim + 2 * arch.kv_heads * arch.head_dim
    return {"context-parallel all-to-all": s.tokens * s.compute_bytes * width}


def _reference_forward(arch: Arch, s: Shape, resident) -> list[Phase]:
    """The frozen reference's forward without gradient: a gathered block (and the prefetched one) with
    its transient activations, then the log-probs of its output."""
    n, c = s.tokens, s.compute_bytes
    big = max(arch.blocks, key=lambda b: b.params)
    ref = {**resident, "reference root group": c * arch.root_params}
    block = {"reference blocks (unsharded)": 2 * c * _unsharded(arch, s, big),
             "block activations (no grad)": n * block_bytes(arch, big, c, s.kv_repeat, s.eager_seq) / 2}  # fmt: skip
    return [
        Phase("reference forward: decoder block", {**ref, **block}),
        Phase("reference forward: log-probs", {**ref, **logprobs.no_grad_forward(arch, s)}),
    ]
