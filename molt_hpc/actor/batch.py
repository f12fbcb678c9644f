"""Cutting one step's experience into this rank's micro-batches, and the model forwards over them.

Every rank holds the whole step's `Experience` (rank 0 shared the groups); rows (or packed rows,
`molt_hpc.actor.packing`) are dealt to data-parallel ranks inside each mini-batch, so token counts per
rank differ and the global token mean evens it out. FSDP needs every rank to run the same number of
forwards: a rank short of rows runs a padding micro-batch whose action mask is empty (it contributes
exactly zero). A model on document attention (packing, context parallelism) is fed through
`molt_hpc.parallel.attention.RowSlice`: this rank's slice of the rows, outputs gathered back whole.
"""

import itertools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from molt_hpc.actor.head import hidden_and_head
from molt_hpc.actor.packing import rank_micro_batches
from molt_hpc.actor.vision import ImageInputs
from molt_hpc.actor.world import World
from molt_hpc.algorithm import Experience, token_logprobs
from molt_hpc.algorithm.distill import gathered_logprobs, topk_forward_kl
from molt_hpc.algorithm.logprobs import exact_token_logprobs
from molt_hpc.models.exact import is_exact
from molt_hpc.parallel.attention import attention_setup


def mini_batch_rows(exp: Experience, mini_batches: int) -> list[Tensor]:
    """Row indices of each mini-batch: the groups cut into `mini_batches` consecutive parts."""
    row_sample = exp.seq_index[:, 0]
    row_group = exp.group_index[row_sample]
    n_groups = int(exp.group_index.max().item()) + 1
    bounds = [round(i * n_groups / mini_batches) for i in range(mini_batches + 1)]
    return [torch.nonzero((row_group >= lo) & (row_group < hi)).flatten() for lo, hi in itertools.pairwise(bounds)]


def my_rows(rows: Tensor, world: World) -> Tensor:
    """This data-parallel rank's share of `rows` (unpacked: round-robin)."""
    return rows[world.dp_rank :: world.dp_size]


def policy_logprobs(
    model: nn.Module,
    mb: Experience,
    temperature: float,
    chunk: int,
    kernel: str = "torch",
    *,
    images: ImageInputs | None = None,
    top_kl: list[Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """(log-prob, entropy) `[B, T]` of each action token under `model` at the sampling temperature.

    From the last hidden states and the LM head weight (`molt_hpc.actor.head`), chunk by chunk: no
    `[B, T, V]` logits in forward or backward; models whose head does more than a matmul go through
    their full logits. Position ids restart per sample; no attention mask and no KV cache (with either,
    transformers would not confine attention to each sample of a packed row; see
    `molt_hpc.algorithm.experience`). A vision-language model also gets the micro-batch's pixel values
    and multimodal positions (`images`); a dummy-image row it may add is cut off the outputs. With
    `top_kl` (a list; `distill.top_k`), the same forward's `[B, T]` forward KL on the teacher's top-k support
    at each action token (`distill.topk_forward_kl`, differentiable) is appended to it.
    """
    how = {"temperature": temperature, "chunk": chunk, "kernel": kernel}
    logprobs_of = token_logprobs
    if is_exact(model):  # engines.exact: the engine's own ops (no chunks, no kernel choice)
        logprobs_of, how = exact_token_logprobs, {"temperature": temperature}
    rows_in = mb.sequences.shape[0]
    extra: dict[str, Tensor] = {}
    if images is not None:
        mb, extra = images.inputs(mb)
    setup = attention_setup(model)
    if setup is None:
        inputs = {"input_ids": mb.sequences, "position_ids": mb.position_ids, "use_cache": False, **extra}
        source, weight = head_source(model, inputs)
        logp, ent = logprobs_of(source, mb.sequences, lm_head_weight=weight, mask=mb.action_mask, **how)
        if top_kl is not None:
            nxt = _next(mb.action_mask), _next(mb.teacher_top_ids), _next(mb.teacher_top_log_probs)
            top_kl.append(F.pad(_top_kl(source, weight, *nxt, temperature, chunk)[:, :-1], (1, 0))[:rows_in])
        return logp[:rows_in], ent[:rows_in]
    rows = setup.rows(mb)
    source, weight = head_source(model, {**rows.inputs, **extra})
    logp, ent = logprobs_of(source, rows.next_tokens, lm_head_weight=weight, aligned=True, mask=rows.next_action, **how)
    if top_kl is not None:
        ids, teacher = rows.local(_next(mb.teacher_top_ids)), rows.local(_next(mb.teacher_top_log_probs))
        top_kl.append(
            rows.own_index(_top_kl(source, weight, rows.next_action, ids, teacher, temperature, chunk))[:rows_in]
        )
    return rows.own_index(logp)[:rows_in], rows.own_index(ent)[:rows_in]


def _next(x: Tensor | None) -> Tensor:
    """A per-token tensor `[B, T, ...]` at prediction index: column j holds token j+1's (0 past the end)."""
    assert x is not None, "the batch carries no teacher top tokens (distill.top_k)"
    return torch.cat([x[:, 1:], torch.zeros_like(x[:, :1])], dim=1)


def _top_kl(source: Tensor, weight, sel: Tensor, ids: Tensor, teacher: Tensor, temperature: float, chunk: int):
    """`[B, S]` top-k forward KL at the prediction-index positions `sel` of `source [B, S, ·]`, 0 elsewhere."""
    b, s = sel.shape
    pick = sel.to(torch.bool)
    flat = source.reshape(b * s, source.shape[-1])[pick.flatten()]
    student = gathered_logprobs(flat, weight, ids[pick], temperature, chunk)
    kl = topk_forward_kl(teacher[pick].to(student.device), student, torch.ones(student.shape[0], dtype=torch.bool,
                                                                             device=student.device))  # fmt: skip
    return torch.zeros((b, s), dtype=kl.dtype, device=kl.device).masked_scatter(pick, kl)


def head_source(model: nn.Module, inputs: dict) -> tuple[Tensor, Tensor | None]:
    """What the log-probs are computed from: the last hidden states and the LM head weight when the model's
    head qualifies (`head.hidden_and_head`), else the model's own logits and None."""
    fused = hidden_and_head(model, inputs)
    return (fused.hidden, fused.weight) if fused is not None else (model(**inputs).logits, None)


def critic_values(critic: nn.Module, mb: Experience) -> Tensor:
    """`[B, T]` values at the own index: the estimate before token t, from the hidden state at t-1."""
    setup = attention_setup(critic)
    if setup is None:
        v = critic(input_ids=mb.sequences, position_ids=mb.position_ids, use_cache=False).logits[..., 0].float()
        return nn.functional.pad(v[:, :-1], (1, 0))
    rows = setup.rows(mb)
    return rows.own_index(critic(**rows.inputs).logits[..., 0].float())


@torch.no_grad()
def rows_forward(fn, exp: Experience, rows: Tensor, size: int, budget: int | None, world: World) -> Tensor:
    """`fn(micro_batch) -> [b, t]` over this rank's share of `rows`, gathered into the whole batch's `[B, T]`.

    Every row is computed by one data-parallel rank (the ranks of a CP group compute the same rows:
    only the first of them contributes), so one all-reduce of `[B, T]` sums the shares into the whole,
    exactly (each value is added to zeros)."""
    mine = torch.zeros(exp.sequences.shape, dtype=torch.float32)
    for mb in rank_micro_batches(exp, rows, size, budget, world):
        mb.put(mine, fn(mb.batch.to(world.device)).float().cpu())  # an empty micro-batch puts nothing
    if world.cp_rank != 0:
        mine.zero_()
    if world.size > 1:
        dist.all_reduce(mine)  # on the CPU group (gloo)
    return mine
