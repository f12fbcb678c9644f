"""The running batch's KV cache, preallocated: one slot per row, written in place, never re-allocated.

`ModelRunner`'s `BatchCache` (kvcache.py) grows a transformers `DynamicCache` by concatenation at
every decode step and re-pads it when rows join. `SlotCache` instead allocates once, per layer, K and
V of `[max_batch · max_model_len, kv_heads, head_dim]` (slot-major): row i of the running batch lives
in slot i, its token j at column j, so a row's column is its position id. A decode step writes each
row's new K/V at (slot, position) with one `index_copy_` per layer and attends over the first
`width` columns under an additive mask that hides each row's columns past its own length. Rows join
by having their prefill write its K/V straight into the next free slots (`prefill.py`; the plain
prefill's `DynamicCache` is copied in instead) and leave by moving later rows into the holes, so the
batch is always slots `[0, rows)`. One scratch slot past the last takes the writes of a graphed
prefill's dummy rows. Fixed addresses and shapes are what lets `graphs.py` record
the decode step as a CUDA graph.

The model sees `SlotCache` only through the one method transformers' attention layers call on a
cache, `update(key, value, layer_idx, ...)`, and through a ready 4-D mask, which transformers uses as
it is (full-attention models with the `sdpa` or `eager` kernels). For the decode step the runner
switches the model to `decode_attention`, which folds the query heads that share a K/V head into the
query length instead of copying K/V once per query head (what transformers' SDPA path does with a mask).
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F

from molt_hpc.engine.batch import ModelRunner, plain_rows
from molt_hpc.engine.kvcache import BatchCache
from molt_hpc.engine.prefill import PREFILL_ATTENTION, SlotPart, SlotPrefill, prefill_attention

ATTENTION = ("sdpa", "eager")
"""Attention kernels that take a 4-D additive mask (flash-attention 2 takes none)."""
DECODE_ATTENTION = "molt_slot_decode"
JOIN_BYTES = 256 << 20
"""Most bytes of a prefill's K/V copied into the slots at once (layers are stacked up to this)."""


def decode_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """One query token per row over the slot cache: `query [b, heads, 1, d]`, `key`/`value`
    `[b, kv_heads, width, d]`, the additive mask `[b, 1, 1, width]`; returns `([b, 1, heads, d], None)`
    as transformers' attention functions do. Query heads of one K/V head attend together as a query of
    length heads / kv_heads, so K/V are read in place (grouped-query attention without a repeat)."""
    b, heads, q, d = query.shape
    assert q == 1, "decode_attention serves one-token decode steps"
    groups = key.shape[1]
    out = F.scaled_dot_product_attention(
        query.reshape(b, groups, heads // groups, d), key, value, attn_mask=attention_mask, scale=scaling
    )
    return out.reshape(b, heads, 1, d).transpose(1, 2), None


def kv_shape(config, slots: int, capacity: int) -> tuple[int, int, int]:
    """Shape of one layer's K (or V) in a slot cache of `slots` rows of `capacity` tokens."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return slots * capacity, kv_heads, head_dim


def slot_cache_bytes(config, slots: int, capacity: int, dtype: torch.dtype) -> int:
    """Bytes a `SlotCache` of this shape allocates (K and V of every layer, the scratch slot too)."""
    rows, kv_heads, head_dim = kv_shape(config, slots + 1, capacity)
    return 2 * config.num_hidden_layers * rows * kv_heads * head_dim * dtype.itemsize


def bound_gpu_memory(device: torch.device, fraction: float) -> None:
    """Cap what this process's allocator may take of the GPU (`engines.gpu_memory_utilization`), so an
    engine sharing the trainer's GPU leaves it the rest: beyond the cap an allocation fails here."""
    index = device.index if device.index is not None else torch.cuda.current_device()  # it needs an index
    torch.cuda.set_per_process_memory_fraction(fraction, index)


def check_slot_cache_fits(config, device: torch.device, slots: int, capacity: int, dtype, fraction: float) -> None:
    """A `ValueError` naming the knobs when the weights already loaded plus a slot cache of `slots` ×
    `capacity` tokens would pass `fraction` of the GPU."""
    total = torch.cuda.get_device_properties(device).total_memory
    weights = torch.cuda.memory_allocated(device)
    cache = slot_cache_bytes(config, slots, capacity, dtype)
    if weights + cache > fraction * total:
        gib = 2**30
        raise ValueError(
            f"the engine needs {(weights + cache) / gib:.1f} GiB of GPU memory (weights {weights / gib:.1f} GiB, KV "
            f"cache for engines.max_batch = {slots} x engines.max_model_len = {capacity}: {cache / gib:.1f} GiB) but "
            f"engines.gpu_memory_utilization = {fraction} allows {fraction * total / gib:.1f} GiB of "
            f"{total / gib:.0f} GiB: lower max_batch or max_model_len, or raise gpu_memory_utilization"
        )


class SlotCache:
    """K/V of every running row in fixed slots, plus the write indices of the step in flight."""

    def __init__(self, config, slots: int, capacity: int, dtype: torch.dtype, device: torch.device):
        rows, kv_heads, head_dim = kv_shape(config, slots + 1, capacity)  # + the scratch slot
        layers = config.num_hidden_layers
        # One tensor for every layer's K and V: rows joining or leaving move all layers in one copy
        # (a copy per layer is 2 x layers launches, which cost more than the bytes at a small model).
        self.kv = torch.zeros(2 * layers, rows, kv_heads, head_dim, dtype=dtype, device=device)
        self.keys = list(self.kv[:layers].unbind(0))
        self.values = list(self.kv[layers:].unbind(0))
        self.slots, self.capacity, self.dtype = slots, capacity, dtype
        self.rows = 0
        """Running rows: slots [0, rows)."""
        self.width = 0
        """Columns the step in flight attends over."""
        self._base = torch.arange(slots, device=device) * capacity
        self._dst = torch.zeros(slots, dtype=torch.long, device=device)
        self._cols = torch.arange(capacity, device=device)

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def _view(self, t: torch.Tensor) -> torch.Tensor:
        return t.view(self.slots + 1, self.capacity, *t.shape[1:])

    # -- the running batch ----------------------------------------------------------------------

    def clear(self) -> None:
        self.rows = 0

    def join(self, part: BatchCache) -> None:
        """Append the rows of a prefill (left-padded `DynamicCache` + mask) after the running rows."""
        k, length = part.mask.shape
        assert self.rows + k <= self.slots, "more rows than slots; the scheduler admits at most max_batch"
        assert length <= self.capacity, "a context longer than max_model_len was admitted"
        valid = part.mask.bool()
        src = valid.reshape(-1).nonzero().squeeze(1)  # (row, column) of every real token, row-major
        column = part.mask.long().cumsum(1) - 1  # a real token's position = its column in the slot
        slot = torch.arange(self.rows, self.rows + k, device=column.device)[:, None]
        dst = (slot * self.capacity + column)[valid].to(self._dst.device)
        src = src.to(self._dst.device)
        theirs = _layer_tensors(part.cache)
        # Layers go in groups of bounded size: one stacked copy per group instead of one per layer
        # (launches cost more than bytes at a small model), without doubling a big prefill's memory.
        group = max(1, JOIN_BYTES // max(1, theirs[0].numel() * theirs[0].element_size()))
        for start in range(0, len(theirs), group):
            part_kv = torch.stack(theirs[start : start + group]).transpose(2, 3)  # [g, k, length, kv_heads, d]
            flat = part_kv.reshape(part_kv.shape[0], k * length, *self.kv.shape[2:])
            self.kv[start : start + group].index_copy_(1, dst, flat.index_select(1, src).to(self.kv.dtype))
        self.rows += k

    def keep(self, order: list[int], width: int) -> None:
        """Keep the rows `order` lists (old slot per new slot), moving those whose slot changes; only their first
        `width` columns hold anything (the longest running row's length)."""
        self._move(list(enumerate(order)), width)
        self.rows = len(order)

    def place(self, part: "SlotPart") -> None:
        """Append the rows of a slot prefill (written from slot `part.start`) after the running rows: row j
        comes from slot `part.start + part.index[j]`, moved or copied where that is not its slot."""
        k = len(part.index)
        assert self.rows + k <= self.slots, "more rows than slots; the scheduler admits at most max_batch"
        self._move([(self.rows + j, part.start + i) for j, i in enumerate(part.index)], max(part.lengths))
        self.rows += k

    def _move(self, pairs: list[tuple[int, int]], width: int) -> None:
        """Copy the first `width` columns of slot `old` to slot `new` for each `(new, old)` that differ."""
        moves = [(new, old) for new, old in pairs if new != old]
        if moves:
            dev = self._dst.device
            new = torch.tensor([n for n, _ in moves], device=dev)
            old = torch.tensor([o for _, o in moves], device=dev)
            view = self.kv.view(len(self.kv), self.slots + 1, self.capacity, *self.kv.shape[2:])[:, :, :width]
            view.index_copy_(1, new, view.index_select(1, old))  # the copy is taken before any slot is written

    # -- one decode step ------------------------------------------------------------------------

    def begin_step(self, positions: torch.Tensor, width: int) -> torch.Tensor:
        """Set up a decode step of `len(positions)` rows (slots [0, b)) attending over `width` columns;
        returns its additive mask `[b, 1, 1, width]` (0 where a row may look, the dtype's minimum elsewhere)."""
        b = positions.shape[0]
        assert width <= self.capacity
        torch.add(self._base[:b], positions, out=self._dst[:b])
        self.width = width
        allowed = self._cols[:width][None, :] <= positions[:, None]
        mask = torch.zeros(allowed.shape, dtype=self.dtype, device=allowed.device)
        return mask.masked_fill_(~allowed, torch.finfo(self.dtype).min)[:, None, None, :]

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        """transformers' cache hook: store the step's K/V `[b, kv_heads, 1, head_dim]` at each row's
        position and return the attended K/V `[b, kv_heads, width, head_dim]` (views, no copies)."""
        b = key.shape[0]
        assert key.shape[2] == 1, "the slot cache serves decode steps; prefill runs on a DynamicCache"
        k_all, v_all = self.keys[layer_idx], self.values[layer_idx]
        k_all.index_copy_(0, self._dst[:b], key[:, :, 0])
        v_all.index_copy_(0, self._dst[:b], value[:, :, 0])
        width = self.width
        return (
            self._view(k_all)[:b, :width].transpose(1, 2),
            self._view(v_all)[:b, :width].transpose(1, 2),
        )


class SlotRunner(ModelRunner):
    """A `ModelRunner` whose running batch lives in a `SlotCache`; on a GPU its decode steps may replay
    CUDA graphs (`graphs=True`), with plain sampling inside them (`sampling=True`); `fuse=True` fuses
    each layer's q/k/v and gate/up projections (`fuse.py`); `compile` (a `torch.compile` backend,
    "inductor" in the engine) compiles the decode step with dynamic shapes, and the graphs then record
    its fused kernels. `slot_prefill=True` prefills straight into the slot cache (`prefill.py`), from CUDA
    graphs when `prefill_graphs` (default: `graphs`); `False` runs the plain runner's prefill and copies
    its cache in (router replay needs it: its recorder reads the plain prefill's left-padded rows)."""

    def __init__(
        self,
        model,
        device: torch.device,
        *,
        max_batch: int,
        max_model_len: int,
        graphs: bool = False,
        sampling: bool = False,
        fuse: bool = False,
        compile: str | Callable | None = None,
        slot_prefill: bool = True,
        prefill_graphs: bool | None = None,
    ):
        super().__init__(model, device)
        from molt_hpc.models.exact import is_exact

        exact = is_exact(model)
        # exact log-probs need the trainer's own projections, the eager step's kernels and the one sampler
        assert not (exact and (fuse or compile is not None or sampling)), "engines.exact: no fuse, compile, sampling"
        if fuse:  # before anything reads the parameters: the fused weights are what refits write
            from molt_hpc.engine.fuse import fuse_projections

            fuse_projections(model)
        attn = getattr(model.config, "_attn_implementation", "sdpa")
        if attn not in ATTENTION and not exact:
            raise ValueError(f"the slot cache needs attention {' or '.join(ATTENTION)}, not {attn!r}")
        from transformers import AttentionInterface

        AttentionInterface.register(DECODE_ATTENTION, decode_attention)
        AttentionInterface.register(PREFILL_ATTENTION, prefill_attention)
        self.decode_attention, prefill_kind = DECODE_ATTENTION, PREFILL_ATTENTION
        if exact:  # the same kernels as the trainer's exact attention (`engine.exact_slots`)
            from molt_hpc.engine import exact_slots

            self.decode_attention, prefill_kind = exact_slots.register()
        self.slots = SlotCache(model.config, max_batch, max_model_len, model.dtype, device)
        self.prefiller = None
        if slot_prefill and model.get_output_embeddings() is not None:
            record = graphs if prefill_graphs is None else prefill_graphs
            self.prefiller = SlotPrefill(
                model, self.slots, device, self._cache_kw, graphs=record, attention=prefill_kind
            )
        # The per-layer elementwise work (norms, rotary, residuals, the activation) is ~30 small kernels a
        # layer eager; compiled, each chain is one kernel, so a recorded step replays a fraction of the
        # launches. Dynamic shapes: one compile serves every (batch, width) bucket (plus width = capacity).
        self._forward = self._step
        if compile is not None:
            self._forward = torch.compile(self._step, backend=compile, dynamic=True, fullgraph=True)
        self.graphs = None
        if graphs:
            from molt_hpc.engine.graphs import DecodeGraphs

            self.graphs = DecodeGraphs(self, sampling=sampling)

    @torch.inference_mode()
    def prefill(self, contexts: list[list[int]], images: list | None = None):
        if self.prefiller is None:
            return super().prefill(contexts, images)
        assert not any(images or []), "images reached a text model's runner"
        start = self.slots.rows  # the next free slots; `join` moves the rows if the batch restarts
        assert start + len(contexts) <= self.slots.slots, "more rows than slots; release the stale batch first"
        logits = self.prefiller.run(contexts, start)
        return logits, SlotPart(start, [len(c) for c in contexts])

    def join(self, batch: SlotCache | None, part: BatchCache | SlotPart) -> SlotCache:
        if batch is None:  # a new batch (the last one ended or went stale): start from slot 0
            self.slots.clear()
        if isinstance(part, SlotPart):
            self.slots.place(part)
        else:
            self.slots.join(part)
        return self.slots

    def release(self) -> None:
        self.slots.clear()

    @torch.inference_mode()
    def decode_sampled(self, batch: SlotCache, rows, last: list[int], positions: list[int], bits: list[int]):
        if self.graphs is None or not self.graphs.sampling or not plain_rows(rows):
            return None
        assert batch is self.slots and batch.rows == len(last)
        return self.graphs.run_sampled(last, positions, [r.params.temperature for r in rows], bits)

    @torch.inference_mode()
    def decode(self, batch: SlotCache, last: list[int], positions: list[int]) -> torch.Tensor:
        assert batch is self.slots and batch.rows == len(last)
        if self.graphs is not None:
            return self.graphs.run(last, positions)
        ids = torch.tensor(last, device=self.device)[:, None]
        return self.step(ids, torch.tensor(positions, device=self.device), max(positions) + 1)

    def step(self, ids: torch.Tensor, positions: torch.Tensor, width: int) -> torch.Tensor:
        """One decode forward of rows [0, b): `ids [b, 1]` at `positions [b]`; next-token logits [b, V]."""
        return self._forward(ids, positions, width)

    def _step(self, ids: torch.Tensor, positions: torch.Tensor, width: int) -> torch.Tensor:
        mask = self.slots.begin_step(positions, width)
        config = self.model.config
        prefill_attention = config._attn_implementation
        config._attn_implementation = self.decode_attention  # this step only; prefill keeps the model's kernel
        try:
            out = self.model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=positions[:, None],
                use_cache=True,
                **{self._cache_kw: self.slots},
            )
        finally:
            config._attn_implementation = prefill_attention
        return out.logits[:, -1]


def _layer_tensors(cache) -> list[torch.Tensor]:
    """Keys of every layer, then values of every layer, of a transformers `DynamicCache`."""
    layers = cache.layers
    return [layer.keys for layer in layers] + [layer.values for layer in layers]
