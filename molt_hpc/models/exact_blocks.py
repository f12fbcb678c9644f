"""Exact attention as fixed-shape block matrix multiplies: the fast path of `models.exact_attention`.

A query's result must not depend on where its keys sit in the batch (left padding of the engine's KV
cache, the trainer's right padding, other samples packed in the row, the cache's length). Two steps make it so:

- **Layout** (`key_layout`): each batch row's keys are gathered so that every query finds its allowed keys at
  columns `start, start + 1, ...` in order, with `start` a multiple of the block size. Consecutive queries
  whose allowed keys are each a prefix (in key order) of the next one's (a causal mask, padded or not) form a
  group that shares one run of columns, the allowed keys of its last query; a query that is not such a
  prefix (a new sample of a packed row, the trainer's padding, any other mask) starts a new group with its
  own run. A query's keys then land in the same block columns whatever else is in the batch.
- **Blocks** (`blocked_attention`): the columns are cut into blocks of `BLOCK` keys. Per block, one matrix
  multiply `[rows, D] x [D, BLOCK]` gives the scores and one `[rows, BLOCK] x [BLOCK, D + 1]` (values with a
  ones column appended) gives the softmax's numerator and denominator together; the blocks' partial sums are
  added strictly left to right. Masked keys (weight exactly 0), other groups' blocks and trailing padding add
  exact zeros, and blocks with none of a query chunk's keys are skipped, so a query gets the bits it gets
  attending over exactly its own keys alone.

That holds only if the multiplies give a row the same bits whatever the other rows, the row's offset and the
number of matrices in the batch (on a CUDA GPU they run `models.exact_cuda`'s fixed-tile kernel):
`block_rows` checks it once per head size, dtype and device (and finds the fewest rows a multiply needs for
it), and `models.exact_attention` runs its sequential `cumsum` form where it does not hold (on a GPU, where
`cumsum` is a parallel scan, it refuses instead).
"""

import math
import threading

import torch
import torch.nn.functional as F
from torch import Tensor

from molt_hpc.models.exact_linear import ROWS

BLOCK = 32
"""Keys per block: every score multiply is `[rows, D] x [D, BLOCK]`, every value multiply `[rows, BLOCK] x
[BLOCK, D + 1]`."""
BUDGET = 1 << 23
"""Most elements of one query chunk's `[B, H, blocks, rows, BLOCK]` scores."""
CHUNK = 128
"""Queries per chunk (at most): a chunk of causal queries computes only the blocks up to its last key."""
MASKED = -1e30
"""Added to a masked key's score: finite (exp's slow paths and inf - inf stay out), below any real score."""
CLAMP = 80.0
"""Shifted scores are clamped to at least -CLAMP before exp: exp(-80) is a normal float (exp of a larger
negative number, or a denormal result, takes the CPU's slow path)."""
CUT = math.exp(1 - CLAMP)
"""Weights at or below this are set to exactly 0 (masked keys: exp(-CLAMP))."""
SPACE = 1 << 24
"""Most elements of one reused buffer (`_buffer`)."""
_CHECKED: dict[tuple, int] = {}
_LOCAL = threading.local()
"""Per thread: the reused buffers (`_buffer`) and the last mask's layout (`_layout`)."""


def _buffer(name: str, shape: tuple[int, ...], like: Tensor) -> Tensor:
    """An uninitialised tensor of `like`'s dtype and device, the same memory from call to call (per thread):
    the OS zeroes fresh memory page by page on first touch, which at a decode step's sizes cost more than the
    multiplies. Only for tensors that do not leave the call."""
    n = math.prod(shape)
    if n > SPACE:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    key = (name, like.dtype, like.device, torch.is_inference_mode_enabled())
    buf = _LOCAL.__dict__.get(key)
    if buf is None or buf.numel() < n:
        buf = _LOCAL.__dict__[key] = torch.empty(n, dtype=like.dtype, device=like.device)
    return buf[:n].view(shape)


def _multiply(a: Tensor, b: Tensor, out: Tensor) -> Tensor:
    """`torch.matmul(a, b, out=out)` of `[B, H, blocks, ...]` operands (broadcast over blocks); on a CUDA GPU
    `models.exact_cuda`'s fixed-tile kernel, B and H flattened into one batch dim."""
    if not a.is_cuda:
        return torch.matmul(a, b, out=out)
    from molt_hpc.models.exact_cuda import matmul

    def flat(t: Tensor) -> Tensor:
        return t.reshape(t.shape[0] * t.shape[1], *t.shape[2:])

    matmul(flat(a), flat(b), out=out.view(out.shape[0] * out.shape[1], *out.shape[2:]))
    return out


def _scores(q: Tensor, keys: Tensor) -> Tensor:
    """q `[B, H, rows, D]`, keys `[B, H, blocks, BLOCK, D]` -> `[B, H, blocks, rows, BLOCK]` (a reused buffer)."""
    out = _buffer("scores", (*keys.shape[:3], q.shape[2], BLOCK), q)
    return _multiply(q[:, :, None], keys.transpose(-1, -2), out)


def _weighted(p: Tensor, values: Tensor) -> Tensor:
    """p `[B, H, blocks, rows, BLOCK]`, values `[B, H, blocks, BLOCK, E]` -> `[B, H, blocks, rows, E]` (a reused
    buffer)."""
    return _multiply(p, values, _buffer("part", (*p.shape[:-1], values.shape[-1]), p))


def _same_rows(fn, x: Tensor, y: Tensor, rows: int) -> bool:
    """Whether `fn(x, y)` (x's rows at dim -2; leading dims [B, H, blocks|none]) gives each row the same bits
    alone (padded to `rows` rows), among a multiple of `rows` others of every size up to hundreds, at other
    offsets, and with fewer matrices in the batch."""
    full = fn(x, y).clone()
    n = x.shape[-2]
    sizes = [rows * i for i in range(1, 9)] + [n // 2 + rows, n - rows]
    among = all(
        torch.equal(fn(x[..., o : o + m, :], y), full[..., o : o + m, :])
        for o, m in zip(range(1, 3 * len(sizes), 3), sizes, strict=False)
    )
    row = F.pad(x[:1, :1, ..., 5:6, :], (0, 0, 0, rows - 1))
    alone = torch.equal(fn(row, y[:1, :1])[..., :1, :], full[:1, :1, ..., 5:6, :])
    fewer = x[1:, 1:, 1:] if x.dim() == 5 else x[1:, 1:]
    return among and alone and torch.equal(fn(fewer, y[1:, 1:, 1:]), full[1:, 1:, 1:])


def block_rows(d: int, dtype: torch.dtype, device: torch.device) -> int:
    """The fewest rows (4, 8 or 16) a block multiply needs for both to give every row the same bits whatever
    else is multiplied with it; 0 where none does (cached per head size, dtype and device). A decode step has
    one query per key head's group: the fewer padding rows, the less it computes."""
    key = (d, BLOCK, dtype, str(device))
    if key not in _CHECKED:
        gen = torch.Generator().manual_seed(0)

        def rand(*shape):
            return torch.randn(*shape, generator=gen).to(device, dtype)

        n = 512  # the trainer's chunks: hundreds of rows
        q, keys = rand(2, 3, n, d), rand(2, 3, 5, BLOCK, d)
        p, values = rand(2, 3, 5, n, BLOCK).exp(), rand(2, 3, 5, BLOCK, d + 1)
        fits = (r for r in (4, 8, ROWS) if _same_rows(_scores, q, keys, r) and _same_rows(_weighted, p, values, r))
        _CHECKED[key] = next(fits, 0)
    return _CHECKED[key]


def key_layout(allowed: Tensor, block: int = BLOCK) -> tuple[Tensor, Tensor, Tensor]:
    """allowed bool `[R, Q, K]` -> (`[R, W]` the key at each column (0 where none), `[R, Q]` each query's first
    column, `[R, Q]` its number of allowed keys); W is a multiple of `block`."""
    r = allowed.shape[0]
    rank = allowed.cumsum(-1, dtype=torch.int32)  # 1-based rank of an allowed key among its query's keys
    count = rank[..., -1]
    # query i's keys are the first count[i] of query i+1's: they share a run of columns
    prefix = (allowed[:, :-1] == (allowed[:, 1:] & (rank[:, 1:] <= count[:, :-1, None]))).all(-1)
    last = torch.cat([~prefix, prefix.new_ones(r, 1)], dim=1)  # a group's last query has all its keys
    blocks = torch.where(last, (count + block - 1) // block, 0)
    ends = blocks.cumsum(-1)
    start = (ends - blocks) * block  # blocks of the groups that end before the query's
    width = max(block, int(ends[:, -1].max()) * block)
    row, query, key = (allowed & last[..., None]).nonzero(as_tuple=True)
    index = torch.zeros(r, width, dtype=torch.long, device=allowed.device)
    index[row, start[row, query] + rank[row, query, key].long() - 1] = key
    return index, start, count


class _Layout:
    """A mask's key layout (`key_layout`) as `[B, Hm, ...]` tensors, with what every layer of a forward derives
    from it: the rows `_gather` copies per number of key heads, each query chunk's blocks and additive mask."""

    def __init__(self, allowed: Tensor, b: int, nk: int):
        hm, nq = allowed.shape[1], allowed.shape[2]
        index, start, count = key_layout(allowed.expand(b, hm, nq, nk).reshape(b * hm, nq, nk))
        self.index, self.start, self.count = (x.view(b, hm, -1) for x in (index, start, count))
        self.nk, self.width = nk, index.shape[-1]
        self._sources: dict[int, Tensor] = {}
        self._chunks: dict[tuple[int, int], tuple[int, int, Tensor]] = {}

    def sources(self, heads: int) -> Tensor:
        """`[B · heads · W]`: the row of `[B · heads · K, E]` keys or values each laid-out row copies."""
        if heads not in self._sources:
            b = self.index.shape[0]
            base = torch.arange(b * heads, device=self.index.device).view(b, heads, 1) * self.nk
            self._sources[heads] = (base + self.index).reshape(-1)
        return self._sources[heads]

    def chunk(self, lo: int, hi: int) -> tuple[int, int, Tensor]:
        """(first block, end block, `[B, Hm, blocks, 1, hi - lo, BLOCK]` additive mask) of queries lo..hi: the
        blocks that hold any of their keys, the mask 0 at a query's columns and MASKED elsewhere. Kept while
        all chunks' masks together stay under BUDGET elements."""
        if (lo, hi) in self._chunks:
            return self._chunks[lo, hi]
        first, count = self.start[..., lo:hi], self.count[..., lo:hi]
        b0 = int(first.min()) // BLOCK
        b1 = max(b0 + 1, -(-int((first + count).max()) // BLOCK))
        col = torch.arange(b0 * BLOCK, b1 * BLOCK, device=first.device).view(-1, 1, 1, BLOCK)
        first, count = first[:, :, None, None, :, None], count[:, :, None, None, :, None]
        outside = (col < first) | (col >= first + count)
        out = (b0, b1, outside.to(torch.float32) * MASKED)
        if sum(x[2].numel() for x in self._chunks.values()) + out[2].numel() <= BUDGET:
            self._chunks[lo, hi] = out
        return out


def _gather(name: str, x: Tensor, layout: _Layout) -> Tensor:
    """x `[B, Hkv, K, E]` -> `[B, Hkv, W / BLOCK, BLOCK, E]` in layout order: whole rows copied by `index_select`
    (a `gather` computes an offset per element)."""
    b, h, nk, e = x.shape
    sources = layout.sources(h)
    out = _buffer(name, (sources.numel(), e), x)
    return torch.index_select(x.reshape(b * h * nk, e), 0, sources, out=out).view(b, h, -1, BLOCK, e)


def _with_ones(v: Tensor) -> Tensor:
    """`[..., D + 1]`: v and a ones column (whose weighted sum is the softmax's denominator)."""
    out = _buffer("ones", (*v.shape[:-1], v.shape[-1] + 1), v)
    out[..., :-1] = v
    out[..., -1] = 1.0
    return out


def _chunk(q: Tensor, keys: Tensor, values: Tensor, bias: Tensor, out: Tensor) -> None:
    """Attention of `q [B, Hkv, group, rows, D]` (rows a multiple of `block_rows`, scaled) over the laid-out
    blocks, written to `out [B, Hkv, group, real, D]`; `bias` is the additive mask of the first `real` rows
    (the others pad the multiplies only: no softmax is computed for them)."""
    b, hkv, g, c, d = q.shape
    nb, real = keys.shape[2], bias.shape[-2]
    full = _scores(q.reshape(b, hkv, g * c, d), keys).view(b, hkv, nb, g, c, BLOCK)
    scores = full[..., :real, :].add_(bias)  # in place, on contiguous memory: broadcast outputs are slow here
    top = scores.amax(-1, keepdim=True).amax(2, keepdim=True).clamp_(min=MASKED / 10)  # exact in any order
    # masked keys (and a query with none allowed): exp(-CLAMP), cut to exactly 0; an allowed key's weight
    # below that is cut too (it is under 1e-34 of the maximum's, which has weight 1)
    F.threshold_(scores.sub_(top).clamp_(min=-CLAMP).exp_(), CUT, 0.0)
    full[..., real:, :] = 0.0
    part = _weighted(full.view(b, hkv, nb, g * c, BLOCK), values)
    total = part[:, :, 0]
    for j in range(1, nb):  # left to right over blocks, on every device (a scan's grouping may vary)
        total.add_(part[:, :, j])
    num, den = total.view(b, hkv, g, c, d + 1)[..., :real, :].split([d, 1], dim=-1)
    torch.div(num, den.clamp(min=1.0), out=out)  # den >= 1 when any key is allowed (exp(0) at the max)


def _layout(allowed: Tensor, b: int, nk: int) -> _Layout:
    """The layout of `allowed [B|1, Hm, Q, K]`, reused while the mask is the same (every layer of a forward
    gets the same mask; a copy of it is kept, so a mask changed in place is seen)."""
    key = (b, nk, allowed.shape, allowed.device)
    last = getattr(_LOCAL, "last", None)
    if not (last and last[0] == key and torch.equal(last[1], allowed)):
        last = _LOCAL.last = (key, allowed.clone(), _Layout(allowed, b, nk))
    return last[2]


def blocked_attention(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor, scaling: float, rows: int) -> Tensor:
    """`[B, Q, H, D]` outputs of q `[B, H, Q, D]` over k, v `[B, Hkv, K, D]`, `allowed` bool `[B|1, 1|H, Q, K]`;
    a query with no allowed key gets 0; every multiply has a multiple of `rows` rows (`block_rows`). Computed
    in float32 for lower precisions. The heads that share a key head are one multiply's rows (one layout of
    their keys, no copy of the keys per head)."""
    b, h, nq, d = q.shape
    out_dtype, dtype = q.dtype, torch.promote_types(q.dtype, torch.float32)
    if allowed.shape[1] != 1:  # a mask per head: a layout per head
        k, v = (x.repeat_interleave(h // k.shape[1], dim=1) for x in (k, v))
    hkv = k.shape[1]
    layout = _layout(allowed, b, k.shape[2])
    keys = _gather("keys", k.to(dtype), layout)
    values = _gather("values", _with_ones(v.to(dtype)), layout)
    q = F.pad(q.to(dtype) * scaling, (0, 0, 0, (-nq) % rows)).reshape(b, hkv, h // hkv, -1, d)
    # causal queries in chunks of CHUNK: a chunk skips the blocks after its last key (blocks without any of
    # its keys would add exact zeros)
    step = max(rows, min(CHUNK, BUDGET // max(1, b * h * layout.width)) // rows * rows)
    out = torch.empty(b, nq, h, d, dtype=out_dtype, device=q.device)
    heads = out.view(b, nq, hkv, h // hkv, d).permute(0, 2, 3, 1, 4)  # written in place: no copies after
    for lo in range(0, nq, step):
        hi = min(lo + step, nq)
        b0, b1, bias = layout.chunk(lo, hi)
        _chunk(q[:, :, :, lo : lo + step], keys[:, :, b0:b1], values[:, :, b0:b1], bias, heads[:, :, :, lo:hi])
    return out
