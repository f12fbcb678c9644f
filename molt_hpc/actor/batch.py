"""Cutting one step's experience into this rank's micro-batches, and the model forwards over them.

Every rank holds the whole step's `Experience` (rank 0 shared the groups); rows are dealt to ranks
round-robin inside each mini-batch, so token counts per rank differ and the global token mean
evens it out. FSDP needs every rank to run the same number of forwards: a rank short of rows runs
a padding micro-batch whose action mask is empty (it contributes exactly zero).
"""

import dataclasses
import itertools

import torch
from torch import Tensor, nn

from molt_hpc.actor.world import World, gather_all
from molt_hpc.algorithm import Experience, logprobs_from_logits


def mini_batch_rows(exp: Experience, mini_batches: int) -> list[Tensor]:
    """Row indices of each mini-batch: the groups cut into `mini_batches` consecutive parts."""
    row_sample = exp.seq_index[:, 0]
    row_group = exp.group_index[row_sample]
    n_groups = int(exp.group_index.max().item()) + 1
    bounds = [round(i * n_groups / mini_batches) for i in range(mini_batches + 1)]
    return [torch.nonzero((row_group >= lo) & (row_group < hi)).flatten() for lo, hi in itertools.pairwise(bounds)]


def my_rows(rows: Tensor, world: World) -> Tensor:
    return rows[world.rank :: world.size]


def micro_batches(exp: Experience, rows: Tensor, size: int, world: World) -> list[Experience]:
    """This rank's micro-batches over `rows`, padded with empty ones to the most any rank has."""
    chunks = [rows[i : i + size] for i in range(0, len(rows), size)]
    most = max(gather_all(len(chunks)))
    out = [exp.rows(c) for c in chunks]
    while len(out) < most:
        pad = exp.rows(torch.tensor([0]))
        out.append(dataclasses.replace(pad, action_mask=torch.zeros_like(pad.action_mask)))
    return out


def policy_logprobs(model: nn.Module, mb: Experience, temperature: float, chunk: int) -> tuple[Tensor, Tensor]:
    """(log-prob, entropy) `[B, T]` of each action token under `model` at the sampling temperature.

    Position ids restart per sample and no attention mask or cache is passed: transformers then builds
    the block-causal mask itself (see `molt_hpc.algorithm.experience`). Models default to
    `use_cache=True`, and with a cache they do not look for packed samples.
    """
    logits = model(input_ids=mb.sequences, position_ids=mb.position_ids, use_cache=False).logits
    return logprobs_from_logits(logits, mb.sequences, temperature=temperature, chunk=chunk, action_mask=mb.action_mask)


def critic_values(critic: nn.Module, mb: Experience) -> Tensor:
    """`[B, T]` values at the own index: the estimate before token t, from the hidden state at t-1."""
    v = critic(input_ids=mb.sequences, position_ids=mb.position_ids, use_cache=False).logits[..., 0].float()
    return nn.functional.pad(v[:, :-1], (1, 0))


@torch.no_grad()
def rows_forward(fn, exp: Experience, rows: Tensor, size: int, world: World, device: torch.device) -> Tensor:
    """`fn(micro_batch) -> [b, T]` over this rank's `rows`, gathered into the whole batch's `[B, T]`."""
    mine = {}
    chunks = [rows[i : i + size] for i in range(0, len(rows), size)]
    for k, mb in enumerate(micro_batches(exp, rows, size, world)):
        out = fn(mb.to(device)).float().cpu()  # padding micro-batches (k beyond chunks) only keep FSDP in step
        if k < len(chunks):
            mine.update({int(r): out[i] for i, r in enumerate(chunks[k])})
    full = torch.zeros(exp.sequences.shape, dtype=torch.float32)
    for part in gather_all(mine):
        for r, values in part.items():
            full[r] = values
    return full
