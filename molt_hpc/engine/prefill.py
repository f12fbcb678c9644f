"""Prefill written straight into the slot cache, and replayed from CUDA graphs on a GPU.

The plain prefill (`ModelRunner.prefill`) is a transformers forward over a left-padded batch into a
`DynamicCache` under a 2-D padding mask, copied into the slots afterwards. On one H100, SmolLM2-135M
(`bench/gpu_prefill.py`), it launches ~1,200-1,400 kernels and takes 28-43 ms of host time whatever its
size, for 3 ms (1-16 rows) to 25 ms (128 rows of <= 100 tokens) of kernels: it is host-bound until the
batch is large. `SlotPrefill` removes both costs:

- **Right padding, no mask.** Token j of a context sits at column j with position j, so plain causal
  attention is exact for every real token (a padding column only attends to what precedes it, and
  nothing reads it). Each layer's K/V go straight to (slot, column) with one `index_copy_`, the slot
  cache's own layout: no `DynamicCache`, no concatenation, no mask, no copy at join. A row's padding
  columns land in its own slot past its length (the decode mask hides them, decode steps overwrite
  them); the dummy rows of a graph bucket land in the slot cache's scratch slot.
- **The last real token's logits.** A pre-hook on the output embeddings gathers each row's last real
  hidden state, so the LM head runs on one position per row and what the model does after it
  (scaling, soft-capping) still applies.
- **Length groups.** Rows are sorted into length buckets (multiples of `LENGTH_STEP`); neighbouring
  buckets are merged while a separate forward would cost more than the padding it saves
  (`REPLAY_TOKENS`), and a group is cut into even forwards of at most `PREFILL_TOKENS` tokens.
- **CUDA graphs** (`graphs=True`): each (rows bucket, length bucket) forward is recorded the first time
  it is needed and replayed after, inputs in one static buffer (one host-to-device copy per forward).
"""

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from molt_hpc.log import get_logger

PREFILL_ATTENTION = "molt_slot_prefill"
LENGTH_STEP = 32
"""Length buckets of the graphed prefill (columns); a row pads at most this many minus one."""
PREFILL_TOKENS = 16384
"""Most (padded) tokens of one forward: bounds a graph's activations (larger admissions run several)."""
REPLAY_TOKENS = 1536
"""A forward's own cost in padded tokens: its ~1,200 kernels take ~2.7 ms at one short row, and a token
~1.7-2 us at 64-128 rows (the measurement above); length buckets merge where one forward of the merged
rows costs no more than two (each `rows_bucket(rows) x width` tokens plus this)."""


def rows_bucket(rows: int, most: int) -> int:
    """Rows a graphed prefill runs for `rows`: a power of two up to 8, then a multiple of 8 (a prefill's
    padding rows cost as much as real ones, so the steps are finer than the decode graphs')."""
    bucket = 1 << max(0, rows - 1).bit_length() if rows <= 8 else -(-rows // 8) * 8
    return min(bucket, most)


def prefill_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Causal attention over right-padded rows (`[b, heads, L, d]`, K/V `[b, kv_heads, L, d]`); no mask is
    needed, so SDPA takes its fused causal kernels, and grouped K/V heads are read in place."""
    out = F.scaled_dot_product_attention(
        query, key, value, is_causal=True, scale=scaling, enable_gqa=key.shape[1] != query.shape[1]
    )
    return out.transpose(1, 2), None


@dataclass
class SlotPart:
    """What a slot prefill wrote: context i in slot `start + i`, `lengths[i]` tokens. `index` names the
    context of each row that joins (the scheduler's shared prefill of identical contexts repeats one)."""

    start: int
    lengths: list[int]
    index: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.index = self.index or list(range(len(self.lengths)))

    @property
    def rows(self) -> int:
        return len(self.index)

    def keep(self, rows: list[int]) -> None:
        """The joining rows are `rows` of the current ones, in that order (repeats allowed)."""
        self.index = [self.index[r] for r in rows]


class SlotWrites:
    """The cache transformers' attention layers call during a slot prefill: each layer's K/V
    `[R, kv_heads, L, d]` go to the slot-cache rows `dst` (one per token, row-major) and are returned
    as they are (a fresh prefill attends over its own tokens only)."""

    def __init__(self, slots, dst: torch.Tensor):
        self.slots, self.dst = slots, dst

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        for store, new in ((self.slots.keys[layer_idx], key), (self.slots.values[layer_idx], value)):
            store.index_copy_(0, self.dst, new.transpose(1, 2).flatten(0, 1).to(store.dtype))
        return key, value


def plan(lengths: list[int], bucketed: bool, capacity: int, most_rows: int, replay: int) -> list:
    """The forwards of one prefill: `(row indices, rows, columns)` each. Bucketed: shapes are graph
    buckets and length buckets merge while that is cheaper (`replay` padded tokens a forward); else
    exact shapes and one group."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    step = LENGTH_STEP if bucketed else 1
    groups: dict[int, list[int]] = {}
    for i in order:
        groups.setdefault(min(-(-lengths[i] // step) * step, capacity), []).append(i)
    keys = sorted(groups)
    if not bucketed:
        keys, groups = [keys[-1]], {keys[-1]: order}

    def cost(n: int, width: int) -> int:  # a forward's padded tokens (dummy rows too) and its own cost
        return replay + rows_bucket(n, most_rows) * width

    merged: list[tuple[int, list[int]]] = []
    for width in keys:  # ascending: a shorter group either stands alone or pads up to this width
        rows = groups[width]
        if merged:
            below, shorter = merged[-1]
            if cost(len(shorter) + len(rows), width) <= cost(len(shorter), below) + cost(len(rows), width):
                rows = merged.pop()[1] + rows
        merged.append((width, rows))
    forwards = []
    for width, rows in merged:
        per = max(1, min(most_rows, PREFILL_TOKENS // width))
        while bucketed and per > 1 and rows_bucket(per, most_rows) * width > PREFILL_TOKENS:
            per -= 1  # the rows bucket pads up: the padded forward stays under the bound too
        count = -(-len(rows) // per)
        per = -(-len(rows) // count)  # as many forwards, evenly filled: fewer padding rows in the last
        for at in range(0, len(rows), per):
            part = rows[at : at + per]
            if bucketed:
                forwards.append((part, rows_bucket(len(part), most_rows), width))
            else:  # exact shapes: the part's own longest row (sorted: its last)
                forwards.append((part, len(part), lengths[part[-1]]))
    return forwards


class SlotPrefill:
    """Prefills contexts of a `SlotRunner` into its slot cache; `graphs=True` replays CUDA graphs."""

    def __init__(self, model, slots, device: torch.device, cache_kw: str, graphs: bool, attention=PREFILL_ATTENTION):
        self.model, self.slots, self.device, self.cache_kw = model, slots, device, cache_kw
        self.attention = attention
        """The attention function (a registered name) of the slot prefill's forwards: `prefill_attention`, or
        under `engines.exact` the exact one (`engine.exact_slots`)."""
        self.graphs = graphs
        self.bucketed = graphs
        """Forwards of bucketed shapes (what graphs replay); eager forwards take exact shapes."""
        tokens = max(PREFILL_TOKENS, slots.capacity)
        self.most_rows = slots.slots
        self.inputs = torch.zeros(2 * tokens + self.most_rows, dtype=torch.long, device=device)
        self.positions = torch.arange(slots.capacity, device=device)[None]
        self.recorded: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.out: torch.Tensor | None = None  # the graphs' logits, `[most_rows, V]`
        self.pool = torch.cuda.graph_pool_handle() if graphs else None
        self._last: torch.Tensor | None = None  # set while a prefill forward runs: the rows' last tokens
        model.get_output_embeddings().register_forward_pre_hook(self._gather_last)

    def _gather_last(self, module, args):
        if self._last is None:  # not a slot prefill (a decode step, the plain prefill)
            return None
        hidden = args[0]
        return (hidden.flatten(0, 1).index_select(0, self._last)[:, None], *args[1:])

    def run(self, contexts: list[list[int]], start: int) -> torch.Tensor:
        """Next-token logits `[len(contexts), V]`; context i's K/V fill slot `start + i`. The logits may be
        a view of the graphs' output buffer: valid until the next prefill."""
        lengths = [len(c) for c in contexts]
        forwards = plan(lengths, self.bucketed, self.slots.capacity, self.most_rows, REPLAY_TOKENS)
        outs = []
        for rows, b, width in forwards:
            logits = self._forward(contexts, rows, start, b, width)[: len(rows)]
            outs.append(logits.clone() if len(forwards) > 1 else logits)
        order = [i for rows, _, _ in forwards for i in rows]
        if order == list(range(len(contexts))):
            return outs[0] if len(outs) == 1 else torch.cat(outs)
        inverse = torch.empty(len(order), dtype=torch.long)
        inverse[torch.tensor(order)] = torch.arange(len(order))
        return torch.cat(outs)[inverse.to(self.device)]

    def _forward(self, contexts, rows: list[int], start: int, b: int, width: int) -> torch.Tensor:
        """Logits `[b, V]` of one forward of `rows` (padded to `b` rows x `width` columns)."""
        n = b * width
        ids = torch.zeros(b, width, dtype=torch.long)
        slot = torch.full((b,), self.slots.slots, dtype=torch.long)  # dummy rows: the scratch slot
        last = torch.arange(b) * width
        for r, i in enumerate(rows):
            ids[r, : len(contexts[i])] = torch.tensor(contexts[i])
            slot[r] = start + i
            last[r] += len(contexts[i]) - 1
        dst = slot[:, None] * self.slots.capacity + torch.arange(width)
        self.inputs[: 2 * n + b].copy_(torch.cat([ids.view(-1), dst.view(-1), last]))  # one host-to-device copy
        if not self.graphs:
            return self._eager(b, width)
        key = (b, width)
        if key not in self.recorded:
            recorded = self._capture(b, width)
            if recorded is None:
                return self._eager(b, width)
            self.recorded[key] = recorded
        graph, out = self.recorded[key]
        graph.replay()
        return out

    def _eager(self, b: int, width: int) -> torch.Tensor:
        n = b * width
        ids, dst, last = self.inputs[:n].view(b, width), self.inputs[n : 2 * n], self.inputs[2 * n : 2 * n + b]
        config = self.model.config
        attention = config._attn_implementation
        config._attn_implementation = self.attention  # this forward only: decode and plain prefill keep theirs
        self._last = last
        try:
            out = self.model(
                input_ids=ids,
                position_ids=self.positions[:, :width],
                use_cache=True,
                logits_to_keep=0,  # every position reaches the LM head's pre-hook, which keeps the last real one
                **{self.cache_kw: SlotWrites(self.slots, dst)},
            )
        finally:
            self._last = None
            config._attn_implementation = attention
        return out.logits[:, 0]

    def _capture(self, b: int, width: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor] | None:
        """Record the forward of `b` rows x `width` columns; its logits land in the output buffer."""
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: it writes the same K/V the replay will, so it changes nothing
            logits = self._eager(b, width)
        torch.cuda.current_stream().wait_stream(side)
        if self.out is None:
            self.out = torch.empty(self.most_rows, logits.shape[-1], dtype=logits.dtype, device=self.device)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                self.out[:b].copy_(self._eager(b, width))
        except RuntimeError:  # this model cannot be captured: prefill eagerly from now on
            get_logger().warning("CUDA graph capture of the prefill failed; prefilling eagerly", exc_info=True)
            self.graphs = False
            return None
        get_logger().info("captured the prefill for %d rows x %d columns (%d graphs)", b, width, len(self.recorded) + 1)
        return graph, self.out
