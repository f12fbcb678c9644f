"""This rank's micro-batches of a step's batch: rows `micro_batch_size` at a time (right-padded to the
longest of them), or samples packed several to a row, up to `actor.max_tokens_per_micro_batch` tokens.

The step's `Experience` holds one sample per row. A `MicroBatch` is an `Experience` of its own plus
where each of its tokens came from in the step's batch (`src_row`, `src_col`): `take` lays any
per-token tensor of the step's batch out like the micro-batch (every field of `TOKEN_FIELDS`, so
replayed MoE routing too), `put` writes a per-token output back. Position ids keep restarting at
every sample, `seq_index` keeps the step's sample numbers, and per-sample tensors stay whole, so the
losses (GSPO's sequence ratio included) and the global token mean are the same packed or not.

Packed rows are cut by first-fit decreasing over the mini-batch's samples, then dealt to the
data-parallel ranks largest first, so ranks get about the same tokens and at most one padding
micro-batch each. The ranks of a CP group deal by data-parallel rank: they share every micro-batch.
"""

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from molt_hpc.actor.world import World, max_over_ranks
from molt_hpc.algorithm.experience import TOKEN_FIELDS, Experience, pack_rows
from molt_hpc.config import MoltConfig
from molt_hpc.config.train import ActorConfig
from molt_hpc.parallel.attention import DocumentAttention, check_model

FILL = {"seq_index": -1, "versions": -1, "routed_experts": -1}
"""Value of a token field where a micro-batch has no token of the step's batch (0 / False otherwise)."""


@dataclass
class MicroBatch:
    """One forward's worth of the step's batch, and where every token of it came from."""

    batch: Experience
    src_row: Tensor
    """`[b, t]` int64: the step batch's row of each token, -1 where there is none (padding)."""
    src_col: Tensor
    """`[b, t]` int64: its column there."""

    def take(self, full: Tensor, fill: float | int | bool = 0) -> Tensor:
        """Any per-token tensor `[B, T, ...]` of the step's batch, laid out like this micro-batch."""
        out = full[self.src_row.clamp(min=0), self.src_col.clamp(min=0)]
        return out.masked_fill_(self._missing(out), fill) if bool((self.src_row < 0).any()) else out

    def put(self, full: Tensor, values: Tensor) -> None:
        """Write this micro-batch's per-token `values [b, t]` into the step batch's `full [B, T]`."""
        have = self.src_row >= 0
        full[self.src_row[have], self.src_col[have]] = values.to(full.device, full.dtype)[have]

    def _missing(self, out: Tensor) -> Tensor:
        miss = self.src_row < 0
        return miss.reshape(*miss.shape, *([1] * (out.dim() - 2))).expand_as(out)


def token_budget(cfg: MoltConfig) -> int:
    """Tokens of one packed micro-batch: the configured budget, else what a padded micro-batch can hold."""
    act = cfg.actor
    return act.max_tokens_per_micro_batch or act.micro_batch_size * cfg.rollout.max_total_tokens


def packing_on(act: ActorConfig, attn: str, model: nn.Module) -> bool:
    """Whether the trainer packs: `on`/`off` as set; `auto` packs whenever the model can be packed
    exactly. It pays on GPUs (varlen flash kernel) and on CPUs (SDPA a sample at a time): 2.0x the
    padded step's tokens/s on a long-tail mix of 16-256 tokens, 4.7x at h256 x 4 layers, and even
    (0.97x) on a narrow 24-128 mix, on this project's 2-core machine (`bench/packing.py`)."""
    if act.packing == "off":
        return False
    if act.packing == "on":
        check_model(model, attn, act.cp)
        return True
    try:
        check_model(model, attn, act.cp)
    except ValueError:
        return False  # `auto` pads what cannot be packed exactly
    return True


def sequence_layout(cfg: MoltConfig, world: World, policy: nn.Module) -> tuple[DocumentAttention | None, int | None]:
    """How the trainer's models run rows: (document attention for `parallelize`, or None for the model's own;
    tokens per packed micro-batch, or None to pad rows)."""
    pack = packing_on(cfg.actor, cfg.model.attn_implementation, policy)
    if not pack and world.cp is None:
        return None, None
    return DocumentAttention(cfg.model.attn_implementation, world.device, world.cp), token_budget(cfg) if pack else None


def row_lengths(exp: Experience, rows: Tensor) -> list[int]:
    """Columns used by each of `rows` (its last real token + 1; at least 1)."""
    real = exp.attention_mask[rows]
    cols = torch.arange(1, real.shape[1] + 1).expand_as(real)
    return torch.where(real, cols, 1).amax(dim=1).tolist()


def padded(exp: Experience, rows: Tensor) -> MicroBatch:
    """`rows` as one micro-batch, cut to the longest of them."""
    n = max(row_lengths(exp, rows))
    part = exp.rows(rows)
    cut = {f: None if getattr(part, f) is None else getattr(part, f)[:, :n] for f in TOKEN_FIELDS}
    return MicroBatch(dataclasses.replace(part, **cut), rows[:, None].expand(-1, n).clone(),
                      torch.arange(n).expand(len(rows), n).clone())  # fmt: skip


def packed(exp: Experience, rows: Tensor) -> MicroBatch:
    """The samples of `rows` one after the other in a single row."""
    lengths = row_lengths(exp, rows)
    src_row = torch.cat([torch.full((n,), int(r)) for r, n in zip(rows, lengths, strict=True)])[None]
    src_col = torch.cat([torch.arange(n) for n in lengths])[None]
    mb = MicroBatch(exp, src_row, src_col)
    fields = {f: None if getattr(exp, f) is None else mb.take(getattr(exp, f), FILL.get(f, 0)) for f in TOKEN_FIELDS}
    mb.batch = dataclasses.replace(exp, **fields)
    return mb


def rank_micro_batches(exp: Experience, rows: Tensor, size: int, budget: int | None, world: World) -> list[MicroBatch]:
    """This data-parallel rank's micro-batches over the mini-batch `rows`: `size` rows each, or packed
    rows of at most `budget` tokens; padded with empty micro-batches to the most any rank has (FSDP
    needs every rank to run the same forwards). A collective."""
    if budget is None:
        mine = rows[world.dp_rank :: world.dp_size]
        parts = [mine[i : i + size] for i in range(0, len(mine), size)]
        make = padded
    else:
        lengths = row_lengths(exp, rows)
        bins = sorted(pack_rows(lengths, budget), key=lambda b: -sum(lengths[i] for i in b))
        parts = [rows[torch.tensor(b)] for b in bins[world.dp_rank :: world.dp_size]]
        make = packed
    out = [make(exp, p) for p in parts]
    most = max_over_ranks(len(out))
    while len(out) < most:
        out.append(_empty(make(exp, torch.tensor([0]))))
    return out


def _empty(mb: MicroBatch) -> MicroBatch:
    """A micro-batch that only keeps FSDP in step: no action token (it contributes exactly zero), no source."""
    mb.batch = dataclasses.replace(mb.batch, action_mask=torch.zeros_like(mb.batch.action_mask))
    mb.src_row = torch.full_like(mb.src_row, -1)
    return mb
