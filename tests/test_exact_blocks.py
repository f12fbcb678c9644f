"""Exact attention's block form (`models.exact_blocks`): a query's output is the bits it gets attending over
exactly its allowed keys alone, whatever the padding (left, right, holes), the cache's length, the other rows
and the other samples of a packed row; the sequential form where the multiplies are not row-invariant; and
the block form is the one this CPU runs for the tiny models' shapes."""

import copy

import pytest
import torch

from molt_hpc.models import exact_attention as ea
from molt_hpc.models import exact_blocks as eb
from molt_hpc.models import load_causal_lm
from molt_hpc.models.exact import make_exact
from molt_hpc.models.exact_attention import _reference, exact_attention

CPU = torch.device("cpu")


def _qkv(b: int, nq: int, nk: int, heads=4, kv=2, d=32, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, heads, nq, d, generator=gen)
    k, v = (torch.randn(b, kv, nk, d, generator=gen) for _ in range(2))
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _alone(q, k, v, allowed, b: int, i: int) -> torch.Tensor | None:
    """`[H, D]` output of query i of row b computed with exactly its allowed keys and nothing else."""
    a = allowed[b if allowed.shape[0] > 1 else 0, 0, i]
    if not a.any():
        return None
    ones = torch.ones(1, 1, 1, int(a.sum()), dtype=torch.bool)
    return exact_attention(q[b : b + 1, :, i : i + 1], k[b : b + 1][:, :, a], v[b : b + 1][:, :, a], ones)[0, 0]


def _assert_each_query_alone(q, k, v, allowed, every: int = 1) -> torch.Tensor:
    out = exact_attention(q, k, v, allowed)  # [B, Q, H, D]
    checked = 0
    for b in range(q.shape[0]):
        for i in range(0, q.shape[2], every):
            want = _alone(q, k, v, allowed, b, i)
            if want is not None:
                assert torch.equal(out[b, i], want), (b, i, float((out[b, i] - want).abs().max()))
                checked += 1
    assert checked > 0
    k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    ref = _reference(q, k, v, allowed, q.shape[-1] ** -0.5)
    assert torch.allclose(out.transpose(1, 2).float(), ref.float(), atol=1e-2 if q.dtype == torch.bfloat16 else 1e-5)
    return out


def _causal_left_padded(pads: list[int], nq: int, nk: int) -> torch.Tensor:
    """The engine's rows: the last nq of nk positions, row b's keys from column pads[b] on."""
    cols = torch.arange(nk)
    pos = torch.arange(nk - nq, nk)[:, None]
    return ((cols <= pos) & (cols >= torch.tensor(pads)[:, None, None]))[:, None]


def _documents(lengths: list[list[int]], t: int) -> torch.Tensor:
    """Rows of causal documents of `lengths` one after the other, as transformers masks packed rows (and
    the trainer's right padding: a document of its own)."""
    masks = []
    for row in lengths:
        doc = torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row))
        doc = torch.cat([doc, torch.full((t - len(doc),), len(row))])
        cols = torch.arange(t)
        masks.append((doc[:, None] == doc[None, :]) & (cols[None, :] <= cols[:, None]))
    return torch.stack(masks)[:, None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_and_decode_rows_get_their_keys_alone_bits(dtype):
    q, k, v = _qkv(4, 9, 45, dtype=dtype)
    _assert_each_query_alone(q, k, v, _causal_left_padded([0, 3, 17, 44], 9, 45))
    q, k, v = _qkv(5, 1, 70, seed=1, dtype=dtype)
    _assert_each_query_alone(q, k, v, _causal_left_padded([0, 1, 31, 33, 69], 1, 70))


def test_a_row_gets_the_same_bits_at_any_cache_length_and_among_any_rows():
    """The same row behind 0, 5 and 40 columns of left padding, alone and among other rows, a hole of
    masked columns in its middle: the same bits."""
    q, k, v = _qkv(1, 3, 30, seed=2)
    mask = _causal_left_padded([0], 3, 30)
    mask[..., 7:11] = False  # a hole (masked columns inside the row)
    want = exact_attention(q, k, v, mask)
    for pad in (5, 40):
        for others in (0, 6):
            qo, ko, vo = _qkv(others + 1, 3, 30 + pad, seed=3 + pad + others)
            qo[others], ko[others, :, pad:], vo[others, :, pad:] = q[0], k[0], v[0]
            mo = _causal_left_padded([0] * others + [pad], 3, 30 + pad)
            mo[others, ..., pad + 7 : pad + 11] = False
            assert torch.equal(exact_attention(qo, ko, vo, mo)[others], want[0]), (pad, others)


def test_padded_and_packed_trainer_rows_get_their_keys_alone_bits():
    q, k, v = _qkv(3, 80, 80, seed=4)
    _assert_each_query_alone(q, k, v, _documents([[80], [33], [5, 40, 17]], 80))
    q, k, v = _qkv(2, 300, 300, seed=5)  # several query chunks, blocks skipped after a chunk's last key
    _assert_each_query_alone(q, k, v, _documents([[300], [130, 41, 100]], 300), every=7)


def test_masks_that_are_not_causal_still_get_their_keys_alone_bits(monkeypatch):
    """A query may allow keys the last query does not (a window, a random mask, a mask per head): its keys
    get a run of columns of their own, and the block form still runs."""
    q, k, v = _qkv(2, 24, 40, seed=6)
    cols, pos = torch.arange(40), torch.arange(16, 40)[:, None]
    window = ((cols <= pos) & (cols > pos - 6))[None, None]
    gen = torch.Generator().manual_seed(7)
    random = torch.rand(2, 1, 24, 40, generator=gen) < 0.4
    calls = []
    real = eb.blocked_attention
    monkeypatch.setattr(ea, "blocked_attention", lambda *a: calls.append(1) or real(*a))
    for mask in (window, random):
        _assert_each_query_alone(q, k, v, mask)
    assert calls and (window[0, 0, 0] & ~window[0, 0, -1]).any()
    per_head = torch.rand(2, 4, 24, 40, generator=gen) < 0.5
    out = exact_attention(q, k, v, per_head)
    for h in range(4):
        mask = per_head[:, h : h + 1]
        kh, vh = k[:, h // 2 : h // 2 + 1], v[:, h // 2 : h // 2 + 1]
        assert torch.equal(out[:, :, h : h + 1], exact_attention(q[:, h : h + 1], kh, vh, mask))


def test_the_layout_puts_each_querys_keys_in_order_from_a_block_start():
    gen = torch.Generator().manual_seed(8)
    allowed = torch.cat([_documents([[20, 30]], 64)[:, 0], torch.rand(2, 64, 64, generator=gen) < 0.3])
    index, start, count = eb.key_layout(allowed)
    assert index.shape[1] % eb.BLOCK == 0 and bool((start % eb.BLOCK == 0).all())
    for r in range(allowed.shape[0]):
        for i in range(64):
            keys = allowed[r, i].nonzero()[:, 0]
            assert torch.equal(index[r, start[r, i] : start[r, i] + count[r, i]], keys)


def test_the_sequential_form_where_the_multiplies_are_not_row_invariant(monkeypatch):
    """A multiply whose row's bits depend on the row count fails the check (`block_rows` 0), and attention then
    runs the sequential form, which gives each query its keys-alone bits too."""
    monkeypatch.setattr(eb, "_CHECKED", {})
    monkeypatch.setattr(eb, "_weighted", lambda p, values: p @ values * (1.0 + 1e-6 * p.shape[-2]))
    assert eb.block_rows(32, torch.float32, CPU) == 0
    taken = []
    monkeypatch.setattr(ea, "blocked_attention", lambda *a: taken.append("blocks"))
    real_core = ea._core
    monkeypatch.setattr(ea, "_core", lambda *a: taken.append("sequential") or real_core(*a))
    q, k, v = _qkv(3, 12, 20, seed=9)
    cols, pos = torch.arange(20), torch.arange(8, 20)[:, None]
    mask = (cols <= pos)[None, None] & (torch.rand(3, 1, 1, 20, generator=torch.Generator().manual_seed(1)) < 0.7)
    mask[:, :, 0, 15] = True  # the first query allows a key the last one does not
    mask[:, :, -1, 15] = False
    _assert_each_query_alone(q, k, v, mask)
    assert taken and set(taken) == {"sequential"}


@pytest.mark.parametrize("which", ["tiny_model_dir", "tiny_moe_dir"])
def test_the_tiny_models_run_the_block_form_on_this_cpu(request, monkeypatch, which):
    """The check passes for the tiny models' head sizes in float32 (bfloat16 computes in float32), and a forward
    of an exact model runs every attention call through the blocks, never the sequential form."""
    model = make_exact(load_causal_lm(request.getfixturevalue(which), device="cpu"))
    cfg = model.config
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    assert eb.block_rows(d, torch.float32, CPU) > 0
    calls = {"blocks": 0, "sequential": 0}
    real_blocks, real_core = ea.blocked_attention, ea._core

    def blocks(*a):
        calls["blocks"] += 1
        return real_blocks(*a)

    def core(*a):
        calls["sequential"] += 1
        return real_core(*a)

    monkeypatch.setattr(ea, "blocked_attention", blocks)
    monkeypatch.setattr(ea, "_core", core)
    ids = torch.randint(4, 100, (3, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        copy.deepcopy(model)(input_ids=ids, use_cache=False)
    assert calls["blocks"] == cfg.num_hidden_layers and calls["sequential"] == 0
