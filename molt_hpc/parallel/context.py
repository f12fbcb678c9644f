"""Ulysses context parallelism: the `cp` adjacent ranks of a CP group share each micro-batch, and each
runs the model on its `1/cp` slice of every row.

- **Rows.** The ranks of a CP group hold the same micro-batches (rows are dealt by data-parallel rank).
  A row is padded to a multiple of `cp` (`pad`); each rank feeds the model its slice of the ids and
  position ids (`shard`). `shard` slices *any* per-token tensor `[B, T, ...]` the same way: whatever
  else the model reads per token (replayed MoE routing) goes through it.
- **Attention** needs whole rows: the attention function (`molt_hpc.parallel.attention`) turns the q, k,
  v of the slice into whole rows holding `1/cp` of the heads (`seq_to_head`, an all-to-all), runs the
  real kernel, and turns the output back (`head_to_seq`). KV heads are repeated first when the group
  has more ranks than KV heads (`kv_repeats`). Everything else in a decoder block is per token.
- **Outputs** (log-probs, entropy, values) come back as whole rows through a differentiable
  all-gather (`gather`), so every loss (GSPO's sequence ratio included) sees whole samples, as
  without CP. Its backward sums the CP ranks' gradients of the (identical) loss, `cp` times the
  gradient of one: a rank scales its loss by the data-parallel size where it would use the world
  size, and the global token count runs over data-parallel ranks only (`World.dp_group`).

The collectives are small `autograd.Function`s over the public `dist.all_to_all_single`,
`dist.all_gather` and `dist.all_reduce` (gloo on CPU, NCCL on GPU); the functional-collective names
differ between torch versions.
"""

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor


@dataclass(frozen=True, eq=False)
class ContextParallel:
    """This rank's place in its CP group (`size` ranks, this one `rank`)."""

    group: dist.ProcessGroup | None
    rank: int
    size: int

    def padded_len(self, t: int) -> int:
        return -(-t // self.size) * self.size

    def span(self, t: int) -> slice:
        """This rank's columns of a row padded to `padded_len(t)`."""
        n = self.padded_len(t) // self.size
        return slice(self.rank * n, (self.rank + 1) * n)

    def pad(self, x: Tensor, fill: float | int | bool = 0) -> Tensor:
        """`x [B, T, ...]` padded with `fill` along dim 1 to a multiple of the group size."""
        extra = self.padded_len(x.shape[1]) - x.shape[1]
        if not extra:
            return x
        tail = torch.full((x.shape[0], extra, *x.shape[2:]), fill, dtype=x.dtype, device=x.device)
        return torch.cat([x, tail], dim=1)

    def shard(self, x: Tensor, fill: float | int | bool = 0) -> Tensor:
        """This rank's slice of any per-token tensor `x [B, T, ...]` of a micro-batch (padded with `fill`)."""
        return self.pad(x, fill)[:, self.span(x.shape[1])]

    def gather(self, x: Tensor) -> Tensor:
        """Whole rows `[B, cp·S, ...]` from every rank's slice `[B, S, ...]`, differentiably."""
        return _Gather.apply(x, self) if self.size > 1 else x


def kv_repeats(heads: int, kv_heads: int, cp: int) -> int:
    """How many times each KV head is repeated so that `cp` ranks can split the heads evenly.

    The q heads are split into `cp` consecutive blocks and so must the KV heads: with `r` repeats
    (`repeat_interleave`, which keeps every q head's KV head in its block) there are
    `kv_heads·r = lcm(kv_heads, cp)` of them, which divides `heads` since both factors do.
    Raises a ValueError naming the fix when `cp` does not divide `heads`."""
    if heads % cp:
        raise ValueError(
            f"actor.cp = {cp} does not divide the model's {heads} attention heads: Ulysses context "
            f"parallelism gives each rank heads / cp of them; choose cp among the divisors of {heads}"
        )
    assert heads % kv_heads == 0, f"{kv_heads} KV heads do not group {heads} query heads"
    return cp // math.gcd(kv_heads, cp)


def seq_to_head(x: Tensor, cp: ContextParallel) -> Tensor:
    """`[B, H, S, D]` (this rank's S positions, all heads) -> `[B, H/cp, cp·S, D]` (whole rows, its heads)."""
    b, h, s, d = x.shape
    parts = x.reshape(b, cp.size, h // cp.size, s, d).permute(1, 0, 2, 3, 4)
    out = _AllToAll.apply(parts, cp.group)  # block j now holds rank j's positions of this rank's heads
    return out.permute(1, 2, 0, 3, 4).reshape(b, h // cp.size, cp.size * s, d)


def head_to_seq(x: Tensor, cp: ContextParallel) -> Tensor:
    """`[B, T, H/cp, D]` (attention output: whole rows, this rank's heads) -> `[B, T/cp, H, D]`."""
    b, t, h, d = x.shape
    parts = x.reshape(b, cp.size, t // cp.size, h, d).permute(1, 0, 2, 3, 4)
    out = _AllToAll.apply(parts, cp.group)  # block j now holds this rank's positions of rank j's heads
    return out.permute(1, 2, 0, 3, 4).reshape(b, t // cp.size, cp.size * h, d)


class _AllToAll(torch.autograd.Function):
    """All-to-all along dim 0 (block j goes to rank j); its own adjoint."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        # contiguous first: empty_like keeps a strided gradient's layout and the exchange would scramble it
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


class _Gather(torch.autograd.Function):
    """All-gather along dim 1; backward: the gradients of every rank summed, this rank's slice."""

    @staticmethod
    def forward(ctx, x: Tensor, cp: ContextParallel) -> Tensor:
        ctx.cp, ctx.s = cp, x.shape[1]
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(cp.size)]
        dist.all_gather(parts, x, group=cp.group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.clone(memory_format=torch.contiguous_format)  # reduced in place: not autograd's buffer
        dist.all_reduce(grad, group=ctx.cp.group)
        lo = ctx.cp.rank * ctx.s
        return grad[:, lo : lo + ctx.s], None
