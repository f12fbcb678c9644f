"""Attention confined to each sample of a row, with Ulysses context parallelism around it: one attention
function registered with transformers (`AttentionInterface`), which the trainer's models use when
they pack several samples into a row or split rows over a CP group.

The model code stays untouched. `use_document_attention(model, how)` checks the model,
points its config at the function and attaches an `AttentionSetup`; `AttentionSetup.rows(mb)` turns a
micro-batch into this rank's model inputs plus a `Layout` of the whole rows' documents (samples, and
the padding block), which transformers hands to every layer's attention call (keyword `molt_layout`).
The function then runs:

1. with CP, the sequence → head all-to-all of q, k, v (`context.seq_to_head`);
2. the real kernel over whole rows, each document attending causally to itself only:
   - `sdpa`: torch SDPA, causal, one document at a time (whole rows when no row holds two samples);
   - `sdpa` on CUDA in half precision: torch's varlen flash kernel over the documents (`cu_seqlens`),
     the kernel SDPA's flash backend runs, without a `[T, T]` mask or attention to other samples;
   - `flash_attention_2`: flash-attn's varlen kernel over the same `cu_seqlens`;
3. with CP, the head → sequence all-to-all back.

Refused with a message (a ValueError): `eager`/`flex_attention`, blocks without softmax attention
(linear attention, state-space layers), sliding windows, and head counts that CP cannot split.
"""

import inspect
import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from molt_hpc.algorithm import Experience
from molt_hpc.models.blocks import language_blocks
from molt_hpc.models.exact import is_exact
from molt_hpc.models.exact_attention import exact_documents
from molt_hpc.parallel.context import ContextParallel, head_to_seq, kv_repeats, seq_to_head

ATTENTION = "molt_document_attention"
KERNELS = ("sdpa", "flash_attention_2")
HALF = (torch.float16, torch.bfloat16)


class Layout:
    """The documents of a micro-batch's whole rows (after CP padding), found where position ids restart.
    A plain class on purpose: FSDP would copy a dataclass input at every module."""

    def __init__(self, position_ids: Tensor, real: Tensor, kernel: str, cp: ContextParallel | None, device):
        pos = position_ids.cpu()
        restart = torch.ones_like(pos, dtype=torch.bool)
        restart[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1  # a sample (or the padding block) starts here
        later = restart.cumsum(1) > 1  # in a row's second document or after
        starts = restart.flatten().nonzero().flatten()
        cu = torch.cat([starts, torch.tensor([pos.numel()])])
        self.packed = bool((later & real.cpu()).any())
        """Some row holds real tokens of two documents: attention must keep them apart."""
        self.spans = list(itertools.pairwise(cu.tolist()))
        """(start, end) of every document over the flattened `B·T` positions."""
        self.max_len = max(hi - lo for lo, hi in self.spans)
        self.cu_seqlens = cu.to(device=device, dtype=torch.int32)
        self.kernel, self.cp = kernel, cp
        self.real_spans = real.cpu().flatten()[starts].tolist() if kernel == "exact" else None
        """Per span, whether it is a sample (else the padding block): the exact kernel computes samples only."""
        self._by_length: list[tuple[int, Tensor]] | None = None

    def by_length(self, device) -> list[tuple[int, Tensor]]:
        """(length, the flattened positions of every document of that length, document by document) for each
        distinct document length: the stacks the CPU kernel runs. Built once per micro-batch, on first use."""
        if self._by_length is None:
            starts: dict[int, list[int]] = {}
            for lo, hi in self.spans:
                starts.setdefault(hi - lo, []).append(lo)
            self._by_length = [
                (n, (torch.tensor(s)[:, None] + torch.arange(n)).flatten().to(device)) for n, s in starts.items()
            ]
        return self._by_length


def document_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None,
                       molt_layout: Layout | None = None, **kwargs):  # fmt: skip
    """The registered attention function: q, k, v `[B, H, S, D]` of this rank's positions -> `[B, S, H, D]`."""
    layout = molt_layout
    assert layout is not None, "a model on document attention was called without molt_layout (batch.py passes it)"
    if sliding_window is not None or kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        raise ValueError("document attention runs plain causal softmax attention: no sliding window, softcap, sinks")
    cp = layout.cp
    if cp is not None:
        r = kv_repeats(query.shape[1], key.shape[1], cp.size)
        if r > 1:
            key, value = key.repeat_interleave(r, dim=1), value.repeat_interleave(r, dim=1)
        query, key, value = (seq_to_head(x, cp) for x in (query, key, value))
    kernel = layout.kernel
    if kernel == "varlen" and (not layout.packed or query.dtype not in HALF):
        kernel = "sdpa"  # one document per row needs no varlen kernel; the flash kernel needs half precision
    kernels = {"sdpa": _sdpa, "varlen": _torch_varlen, "flash_attention_2": _flash_varlen, "exact": _exact}
    out = kernels[kernel](query, key, value, layout, scaling, dropout)
    return (head_to_seq(out, cp) if cp is not None else out), None


def _no_mask(*args, **kwargs):
    return None  # no [T, T] mask: the attention function keeps documents apart from the Layout


def _expand_kv(x: Tensor, heads: int) -> Tensor:
    b, kv, t, d = x.shape
    return x if kv == heads else x[:, :, None].expand(b, kv, heads // kv, t, d).reshape(b, heads, t, d)


def _sdpa(q: Tensor, k: Tensor, v: Tensor, layout: Layout, scaling, dropout: float) -> Tensor:
    """Causal SDPA over whole rows, or, when a row holds several documents, over the documents of each
    length stacked as a batch: the CPU's varlen kernel. A `[T, T]` block-causal mask instead cost 2x the
    padded step's time in `bench/packing.py` (SDPA computes every masked score); the stacks compute only
    each sample's scores, in one call per distinct length rather than one per document (a reward-model
    micro-batch holds ~50 pairs' sides of ~20 lengths: its forward and backward ran 20% faster so)."""
    gqa = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
    if not layout.packed:  # padding only follows the sample: plain causal is exact for every real token
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, scale=scaling, is_causal=True, **gqa)
        return out.transpose(1, 2)
    b, h, t, d = q.shape
    qf, kf, vf = (_flat(x) for x in (q, k, v))  # [B·T, H, D]
    outs, order = [], []
    for n, index in layout.by_length(q.device):
        qs, ks, vs = (x[index].view(-1, n, x.shape[1], d).transpose(1, 2) for x in (qf, kf, vf))  # [docs, H, n, D]
        out = F.scaled_dot_product_attention(qs, ks, vs, dropout_p=dropout, scale=scaling, is_causal=True, **gqa)
        outs.append(out.transpose(1, 2).reshape(-1, h, d))
        order.append(index)
    out = torch.empty((b * t, h, d), dtype=q.dtype, device=q.device).index_copy(0, torch.cat(order), torch.cat(outs))
    return out.view(b, t, h, d)


def _exact(q: Tensor, k: Tensor, v: Tensor, layout: Layout, scaling, dropout: float) -> Tensor:
    """`engines.exact`: batch-invariant attention, one document at a time (`models.exact_attention`)."""
    assert dropout == 0.0, "exact attention runs without dropout (the trainer turns it off)"
    spans = [span for span, real in zip(layout.spans, layout.real_spans, strict=True) if real]
    return exact_documents(q, k, v, spans, scaling)


def _flat(x: Tensor) -> Tensor:
    """`[B, H, T, D]` -> `[B·T, H, D]`, the layout of varlen kernels."""
    b, h, t, d = x.shape
    return x.transpose(1, 2).reshape(b * t, h, d)


def _torch_varlen(q: Tensor, k: Tensor, v: Tensor, layout: Layout, scaling, dropout: float) -> Tensor:
    from torch.nn.attention.varlen import varlen_attn

    assert dropout == 0.0, "the varlen kernel runs without dropout (the trainer turns it off)"
    params = inspect.signature(varlen_attn).parameters  # the causal flag moved into window_size after torch 2.10
    kw = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in params:
            kw["enable_gqa"] = True
        else:
            k, v = _expand_kv(k, q.shape[1]), _expand_kv(v, q.shape[1])
    if "scale" in params:
        kw["scale"] = scaling
    elif scaling is not None:
        q = q * (scaling * q.shape[-1] ** 0.5)
    b, h, t, d = q.shape
    cu, n = layout.cu_seqlens, layout.max_len
    return varlen_attn(_flat(q), _flat(k), _flat(v), cu, cu, n, n, **kw).view(b, t, h, d)


def _flash_varlen(q: Tensor, k: Tensor, v: Tensor, layout: Layout, scaling, dropout: float) -> Tensor:
    from flash_attn import flash_attn_varlen_func

    b, h, t, d = q.shape
    cu, n = layout.cu_seqlens, layout.max_len
    out = flash_attn_varlen_func(_flat(q), _flat(k), _flat(v), cu, cu, n, n, dropout_p=dropout,
                                 softmax_scale=scaling, causal=True)  # fmt: skip
    return out.view(b, t, h, d)


@dataclass(frozen=True)
class DocumentAttention:
    """How the trainer's models attend: the real kernel (`model.attn_implementation`), the device, the CP group."""

    attn: str
    device: torch.device
    cp: ContextParallel | None = None


@dataclass(frozen=True)
class AttentionSetup:
    """What a model on document attention needs per forward: the kernel and the CP group (if any)."""

    kernel: str
    """`sdpa`, `varlen` (torch's flash varlen kernel), `flash_attention_2` or `exact` (`engines.exact`)."""
    cp: ContextParallel | None

    def rows(self, mb: Experience) -> "RowSlice":
        return RowSlice(mb, self)


class RowSlice:
    """A micro-batch as this rank feeds it to the model, and its way back to whole rows.

    Per-token outputs of the model come at *prediction* index (column j predicts token j+1);
    `own_index` gathers them over the CP group and moves them to the own-index alignment of
    `molt_hpc.algorithm.experience` (column t is about token t)."""

    def __init__(self, mb: Experience, setup: AttentionSetup):
        self.cp, self.t = setup.cp, mb.sequences.shape[1]
        cp = self.cp
        pad = (lambda x, fill: cp.pad(x, fill)) if cp is not None else (lambda x, fill: x)
        positions = pad(mb.position_ids, 0)  # CP padding: one-token documents, apart from everything
        self.layout = Layout(positions, pad(mb.attention_mask, False), setup.kernel, cp, mb.sequences.device)
        self.inputs = {
            "input_ids": self.local(mb.sequences),
            "position_ids": self.local(positions),
            "use_cache": False,
            "molt_layout": self.layout,
        }
        self.next_tokens = self.local(F.pad(mb.sequences[:, 1:], (0, 1)))
        """`[B, S]` the token each local position predicts (0 past the end)."""
        self.next_action = self.local(F.pad(mb.action_mask[:, 1:], (0, 1)))
        """`[B, S]` whether that token is an action."""

    def local(self, x: Tensor, fill: float | int | bool = 0) -> Tensor:
        """This rank's part of any per-token tensor `[B, T, ...]` of the micro-batch: the hook for
        anything else the model reads per token (replayed MoE routing: `local(routed, -1)`)."""
        return self.cp.shard(x, fill) if self.cp is not None else x

    def own_index(self, x: Tensor) -> Tensor:
        """This rank's `[B, S]` prediction-index output -> the whole rows' `[B, T]`, own-index aligned."""
        whole = (self.cp.gather(x) if self.cp is not None else x)[:, : self.t]
        return F.pad(whole[:, :-1], (1, 0))


def attention_setup(model: nn.Module) -> AttentionSetup | None:
    """The setup `use_document_attention` attached, or None for a model on its own attention."""
    return getattr(model, "molt_attention", None)


def check_model(model: nn.Module, attn: str, cp: int) -> None:
    """Refuse, with what to change, a model that document attention (and CP) cannot run exactly."""
    what = f"actor.cp = {cp}" if cp > 1 else "actor.packing"
    if attn not in KERNELS:
        raise ValueError(
            f"{what} needs model.attn_implementation 'sdpa' or 'flash_attention_2', not {attn!r} "
            f"({attn} materialises every [T, T] score and cannot confine attention to a packed sample)"
        )
    if cp > 1 and is_vision_language(model):
        raise ValueError(
            "actor.cp > 1 splits rows over ranks, but a vision-language model's image features fill tokens of the "
            "whole row: set actor.cp = 1 for this model"
        )
    config = model.config.get_text_config()
    other = sorted(set(getattr(config, "layer_types", None) or []) - {"full_attention"})
    if other or any(not hasattr(b, "self_attn") for b in language_blocks(model)):
        raise ValueError(
            f"{what}: {type(model).__name__} has layers other than full softmax attention "
            f"({', '.join(other) or 'blocks without self_attn'}); their token mixing would cross samples or CP "
            "slices. Set actor.packing = 'off' and actor.cp = 1 for this model"
        )
    if cp > 1:
        heads = config.num_attention_heads
        kv_repeats(heads, getattr(config, "num_key_value_heads", None) or heads, cp)


def use_document_attention(model: nn.Module, how: DocumentAttention) -> None:
    """Switch `model` (a plain transformers model) to document attention around the real kernel."""
    attn, device, cp = how.attn, how.device, how.cp
    check_model(model, attn, cp.size if cp is not None else 1)
    if attn == "flash_attention_2":
        try:
            import flash_attn  # noqa: F401
        except ImportError as err:
            raise ValueError("model.attn_implementation = 'flash_attention_2' needs the flash-attn package") from err
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION, document_attention)
    AttentionMaskInterface.register(ATTENTION, _no_mask)
    kernel = attn
    if attn == "sdpa" and device.type == "cuda" and _has_torch_varlen():
        kernel = "varlen"
    if is_exact(model):
        kernel = "exact"
    if is_vision_language(model):  # the language model attends by document; the vision tower keeps its kernel
        model.config._attn_implementation = {"": ATTENTION, "text_config": ATTENTION}
    else:
        model.config._attn_implementation = ATTENTION
    model.molt_attention = AttentionSetup(kernel=kernel, cp=cp)


def is_vision_language(model: nn.Module) -> bool:
    return getattr(model.config, "vision_config", None) is not None


def _has_torch_varlen() -> bool:
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True
