"""Trainer memory per GPU: persistent state by category, and the working set of each phase of a step.

The trainer keeps fp32 master weights sharded by FSDP2 over the actor pool's N GPUs (`4·P/N`), fp32
gradients (`4·P_trainable/N`, alive from the first backward of an update to its optimizer step) and
AdamW's two fp32 moments (`8·P_trainable/N`); the frozen reference adds `4·P/N`, a critic its own
16 bytes per parameter. `actor.offload` moves the moments (`optimizer`) or all three (`full`) to host.

Forward and backward run in the compute dtype (c bytes). FSDP2 keeps the root group (embeddings,
final norm, LM head) unsharded from forward through backward, gathers one decoder block at a time
(plus the next one it prefetches), reduces gradients in fp32 (the reduce-scatter input of the block
before stays alive while the next block's backward runs), and with expert parallelism a block
gathers only its own EP rank's experts. The log-probs come from bf16 logits `[n, V]`, fp32 chunks of
`actor.logprob_chunk` rows, and a logits-sized gradient in backward (`molt_hpc/algorithm/logprobs.py`).

The peak is the largest phase: the log-prob backward (large vocabularies), a decoder block's
backward (long sequences), the root's reduce-scatter at the end of backward (huge vocab × hidden),
the optimizer step (foreach temporaries) or the reference forward. Numbers are what
`torch.cuda.max_memory_allocated` counts; `verdict.py` adds the CUDA context and allocator slack.
"""

import math
from dataclasses import dataclass, field

from molt_hpc.config import MoltConfig
from molt_hpc.plan.activations import block_bytes, head_bytes, mlp_width
from molt_hpc.plan.arch import Arch

LOGPROB_CHUNK_BYTES = 8
"""Bytes per (chunk row × vocab) of a log-prob chunk besides one compute-dtype copy per side: fp32
logits and softmax in forward; fp32 logits, the gradient chunk and its cast in backward. Measured by
the CPU trace (`tests/test_plan_trace.py`) on chunks that cross rows (the common case)."""
GRAD_TRANSIENT = {False: 3.5, True: 2.6}
"""Peak activation gradients inside a decoder block's backward, in I-wide compute-dtype tensors per
token (without / with activation checkpointing), from the same trace: the SwiGLU backward holds the
gradients of the product, of silu(gate) and of up while the down projection's is still alive."""


@dataclass(frozen=True)
class Shape:
    """What one trainer rank processes, from the config."""

    ranks: int
    """FSDP world: every GPU of the actor pool."""
    cp: int
    ep: int
    rows: int
    """Rows in one micro-batch (fewer than `micro_batch_size` when a rank's share of an update is smaller)."""
    seq: int
    """Tokens per row: rows are padded to the longest in the batch, at most `rollout.max_total_tokens`."""
    micro_batches: int
    """Micro-batches per optimizer update on one rank."""
    compute_bytes: int
    ac: bool
    chunk: int
    kv_repeat: bool
    """k and v repeated to every head (SDPA with a padded row's mask leaves its grouped-query path)."""
    fused_adam: bool
    offload: str
    reference: bool
    critic: bool
    freeze_router: bool
    eager_seq: int = 0
    """The row length when attention is `eager` (it keeps [heads, T, T] scores per row); 0 otherwise."""

    @property
    def tokens(self) -> int:
        """Tokens of one micro-batch on one rank (a CP rank holds 1/cp of each row)."""
        return self.rows * math.ceil(self.seq / self.cp)


def packs(cfg: MoltConfig) -> bool:
    """Whether the trainer packs rows (`molt_hpc.actor.packing`: `auto` packs what attention allows)."""
    return cfg.actor.packing == "on" or (cfg.actor.packing == "auto" and cfg.model.attn_implementation != "eager")


def shape_of(cfg: MoltConfig, ranks: int, device: str) -> Shape:
    """One rank's micro-batch: padded rows of `max_total_tokens`, or one packed row filled to the token
    budget (every sample at full length: the worst case)."""
    act, ro = cfg.actor, cfg.rollout
    dp = max(1, ranks // act.cp)
    rows_per_update = math.ceil(cfg.actor.groups_per_step * ro.n_samples / act.mini_batches)
    mine = math.ceil(rows_per_update / dp)
    if packs(cfg):
        budget = act.max_tokens_per_micro_batch or act.micro_batch_size * ro.max_total_tokens
        rows, seq = 1, min(budget, mine * ro.max_total_tokens)
        micro = math.ceil(mine * ro.max_total_tokens / budget)
    else:
        rows, seq = min(act.micro_batch_size, mine), ro.max_total_tokens
        micro = math.ceil(mine / rows)
    return Shape(
        ranks=ranks, cp=act.cp, ep=act.ep, rows=rows, seq=seq,
        micro_batches=micro, compute_bytes=4 if cfg.model.dtype == "float32" else 2,
        ac=act.activation_checkpointing, chunk=act.logprob_chunk,
        # a padded row's mask sends SDPA's grouped-query attention through repeated k and v; packed
        # rows attend through the varlen kernel (or a sample at a time), without a mask
        kv_repeat=not packs(cfg) and cfg.model.attn_implementation != "flash_attention_2",
        fused_adam=device == "cuda",
        offload=act.offload, reference=cfg.algorithm.uses_reference, critic=cfg.algorithm.uses_critic,
        freeze_router=act.freeze_router,
        eager_seq=math.ceil(ro.max_total_tokens / act.cp) if cfg.model.attn_implementation == "eager" else 0,
    )  # fmt: skip


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
    host = {}
    offloaded = {"none": (), "optimizer": ("optimizer",), "full": ("parameters", "gradients", "optimizer")}
    for key in offloaded[s.offload]:
        host[key] = state[key]
        state[key] = 0.0
    if s.reference:
        state["reference"] = s.compute_bytes * p_all / s.ranks  # stored in model.dtype (it never trains)
    if s.critic:
        p_critic = p_all - (0 if arch.tied else arch.vocab * arch.hidden) + arch.hidden
        state["critic"] = 16 * p_critic / s.ranks
    per_token = sum(block_bytes(arch, b, c, s.kv_repeat, s.eager_seq) for b in arch.blocks)
    acts = {
        "activations (no checkpointing)": n * per_token,
        "activations (checkpointing)": n * c * arch.hidden * arch.layers,
        "log-prob buffers": n * (head_bytes(arch, c) + 2 * c * arch.vocab) + s.chunk * arch.vocab * (c + 8),
    }
    mem = TrainerMemory(state=state, host=host, activations=acts)
    mem.phases = _phases(arch, s, state)
    return mem


def _phases(arch: Arch, s: Shape, state: dict[str, float]) -> list[Phase]:
    n, c, h, v = s.tokens, s.compute_bytes, arch.hidden, arch.vocab
    grads = state["gradients"]
    resident = {k: x for k, x in state.items() if k != "gradients"}
    root = {"root group (unsharded)": c * arch.root_params}
    per_block = [n * block_bytes(arch, b, c, s.kv_repeat, s.eager_seq) for b in arch.blocks]
    kept = [n * c * h] * len(per_block) if s.ac else per_block
    saved = {"saved activations": sum(kept), "final norm, LM head input": n * head_bytes(arch, c),
             "logits": n * c * v}  # fmt: skip
    fwd_grads = {"gradients": grads} if s.micro_batches > 1 else {}
    # the last block running (gathered) while the one FSDP prefetched for backward is gathered too
    two_blocks = {"blocks (unsharded)": 2 * c * _unsharded(arch, s, arch.blocks[-1]), **_ulysses(arch, s)}
    out = [
        Phase(
            "forward: last decoder block",
            {**resident, **fwd_grads, **root, **two_blocks, "saved activations": sum(kept[:-1]) + per_block[-1]},
        ),
        Phase(
            "forward: log-probs",
            {**resident, **fwd_grads, **root, **saved, "log-prob chunk": s.chunk * v * (c + LOGPROB_CHUNK_BYTES)},
        ),
        Phase(
            "backward: log-probs",
            {
                **resident,
                **fwd_grads,
                **root,
                **saved,
                "logits gradient": n * c * v,
                "log-prob chunk": s.chunk * v * (2 * c + LOGPROB_CHUNK_BYTES - 2),
            },
        ),
    ]
    out += _block_backward(arch, s, resident, grads, root, kept, per_block)
    out.append(
        Phase(
            "backward: root reduce-scatter",
            {
                **resident,
                "gradients": grads,
                **root,
                "root gradients (unsharded)": c * arch.root_params,
                "reduce-scatter (fp32)": 4 * arch.root_params,
            },
        )
    )
    opt = {"optimizer step temporaries": 0.0 if s.fused_adam else 4 * (arch.params - arch.router_params) / s.ranks}
    out.append(Phase("optimizer step", {**resident, "gradients": grads, **opt}))
    if s.reference:
        out.append(_reference_forward(arch, s, resident))
    return out


def _unsharded(arch: Arch, s: Shape, block) -> float:
    """Parameters of `block` once FSDP gathered it (with EP: only this rank's experts)."""
    return block.params - block.experts * (1 - 1 / s.ep)


def _block_backward(arch, s, resident, grads, root, kept, per_block) -> list[Phase]:
    """The backward of the last block (all activations alive) and of the first (the previous
    block's reduce-scatter buffer alive, with checkpointing a recomputed block)."""
    n, c, h = s.tokens, s.compute_bytes, arch.hidden
    out = []
    for i, name in ((len(per_block) - 1, "backward: last decoder block"), (0, "backward: first decoder block")):
        block = arch.blocks[i]
        p = _unsharded(arch, s, block)
        # the first micro-batch of an update has only the gradients of the blocks after i so far
        done = grads * sum(b.params for b in arch.blocks[i + 1 :]) / arch.params
        parts = {**resident, "gradients": grads if s.micro_batches > 1 else done, **root,
                 "LM head gradient": c * arch.vocab * h,
                 "saved activations": sum(kept[:i]) + (per_block[i] if s.ac else kept[i]),
                 "block (unsharded)": c * p, "residual gradient": n * c * h,
                 "activation gradients": GRAD_TRANSIENT[s.ac] * n * c * mlp_width(arch, block)}  # fmt: skip
        if i < len(per_block) - 1:
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


def _reference_forward(arch: Arch, s: Shape, resident) -> Phase:
    n, c, v = s.tokens, s.compute_bytes, arch.vocab
    big = max(arch.blocks, key=lambda b: b.params)
    return Phase("reference forward", {**resident, "reference root group": c * arch.root_params,
                 "reference blocks (unsharded)": 2 * c * _unsharded(arch, s, big),
                 "block activations (no grad)": n * block_bytes(arch, big, c, s.kv_repeat, s.eager_seq) / 2,
                 "logits": n * c * v, "log-prob chunk": s.chunk * v * (c + LOGPROB_CHUNK_BYTES)})  # fmt: skip
