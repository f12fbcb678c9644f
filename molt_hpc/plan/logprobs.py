"""The trainer's log-prob working sets: what is alive at each moment of `policy_logprobs` and its backward.

`molt_hpc/algorithm/logprobs.py` (`_ChunkedLogProbs`) works `actor.logprob_chunk` positions at a time
(at most the micro-batch's tokens), with the `torch` kernel of `logprob_kernels.py` counted: the
`compile` and `triton` kernels hold fewer fp32 temporaries, so this is their upper bound. Two paths,
as `molt_hpc/actor/head.py` decides for the model (`Shape.fused_head`):

- **Fused head** (a bias-free linear LM head applied as it is). The model runs its head on one position
  per row; the chunked function keeps the last hidden states `[n, h]` (after the final norm, already
  counted as the LM head input) for backward. Forward computes each chunk's logits `hidden[rows] @ W.T`
  and its stats, and drops both. Backward first allocates the hidden states' gradient `[n, h]` and the
  head's fp32 accumulator `[V, h]`; per chunk it recomputes the logits, turns them into their gradient in
  place (one fp32 copy of the chunk; one more with an entropy bonus), then `grad[rows] = dz @ W` and
  `acc += (dz.T @ hidden[rows]).float()`: a `[V, h]` product in the compute dtype and its fp32 cast alive
  together with the chunk. The accumulator's cast back at the end (`[V, h]` twice, no chunk) holds less,
  and leaves the same compute-dtype head gradient the full-logits path has (counted with the blocks).
  The previous chunk's gradient stays referenced (the loop's `dz`) until the next gradient pass returns.
- **Full logits** (soft-capping, logit scaling, a head bias...). The model's logits `[n, V]` in the
  compute dtype are the chunked function's saved input; backward fills a logits-sized gradient chunk by
  chunk. A chunk whose positions are not consecutive (it crosses rows, or skips prompt tokens: the
  common case) is gathered, so it and its gradient are copies until scattered back; the previous
  chunk's gradient copy stays referenced through the next chunk's gradient pass.

Every count is from the code: which tensors exist at once, each `[chunk, V]`, `[V, h]` or `[n, h]`.
"""

from typing import TYPE_CHECKING

from molt_hpc.plan.activations import head_bytes
from molt_hpc.plan.arch import Arch

if TYPE_CHECKING:
    from molt_hpc.plan.shape import Shape

STATS_FP32 = 3
"""fp32 `[chunk, V]` tensors the stats pass holds at once (`logprob_kernels.torch_stats`): the scaled
copy z, the softmax p, and p·z, which `torch.linalg.vecdot` materialises before it sums."""
GRAD_FP32 = 1
"""fp32 `[chunk, V]` tensors the gradient pass holds (`logprob_kernels.torch_grad`): the scaled copy z
(exponentiated in place into p, the product written into the chunk's own buffer); an entropy bonus in
the loss adds one more, the per-element factor `b - ge·z/T`."""


def chunk_rows(s: "Shape") -> int:
    """Positions in one chunk: `actor.logprob_chunk`, or all of a smaller micro-batch."""
    return min(s.chunk, s.tokens)


def saved(arch: Arch, s: "Shape") -> dict[str, float]:
    """What the log-probs keep from their forward to their backward, beyond the decoder blocks' own."""
    n, c = s.tokens, s.compute_bytes
    out = {"final norm, LM head input": n * head_bytes(arch, c)}
    if not s.fused_head:
        out["logits"] = n * c * arch.vocab
    return out


def forward_chunk(arch: Arch, s: "Shape") -> dict[str, float]:
    """One chunk in the stats pass: its logits (recomputed, or gathered from the full ones) and fp32 temporaries."""
    return {"log-prob chunk": chunk_rows(s) * arch.vocab * (s.compute_bytes + 4 * STATS_FP32)}


def backward_moments(arch: Arch, s: "Shape") -> list[tuple[str, dict[str, float]]]:
    """(phase name, the log-prob parts alive then) for each moment of the log-probs' backward."""
    n, c, h, v, m = s.tokens, s.compute_bytes, arch.hidden, arch.vocab, chunk_rows(s)
    fp32 = GRAD_FP32 + (1 if s.entropy_grad else 0)
    previous = {"previous chunk's gradient": m * v * c} if n > m else {}
    if not s.fused_head:
        # the gathered chunk and its gradient (copies), the fp32 temporaries
        chunk = {"log-prob chunk": m * v * (2 * c + 4 * fp32), **previous}
        return [("backward: log-probs", {"logits gradient": n * c * v, **chunk})]
    if s.lora:  # a frozen head: no weight gradient, only the hidden states' (`needs_input_grad`)
        return [("backward: log-probs", {"hidden-state gradient": n * c * h,
                                         "log-prob chunk": m * v * (c + 4 * fp32), **previous})]  # fmt: skip
    grads = {"hidden-state gradient": n * c * h, "LM head gradient accumulator (fp32)": 4 * v * h}
    cast = 4 if c != 4 else 0  # `.to(float32)` of an fp32 product is the product itself
    return [
        ("backward: log-probs", {**grads, "log-prob chunk": m * v * (c + 4 * fp32), **previous}),
        ("backward: LM head gradient", {**grads, "log-prob chunk": m * v * c,
                                        "chunk's head gradient and its fp32 cast": v * h * (c + cast)}),
    ]  # fmt: skip


def no_grad_forward(arch: Arch, s: "Shape") -> dict[str, float]:
    """A forward without gradient (the reference's): the model's output and one chunk in the stats pass."""
    n, c = s.tokens, s.compute_bytes
    out = {"last hidden states": n * c * arch.hidden} if s.fused_head else {"logits": n * c * arch.vocab}
    return {**out, **forward_chunk(arch, s)}


def buffers(arch: Arch, s: "Shape") -> float:
    """The log-probs' largest moment beyond the decoder blocks: what they keep plus their working set."""
    kept = sum(saved(arch, s).values())
    moments = [forward_chunk(arch, s), *(parts for _, parts in backward_moments(arch, s))]
    return kept + max(sum(p.values()) for p in moments)
