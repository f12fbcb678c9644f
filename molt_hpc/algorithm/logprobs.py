"""Per-token log-probs and entropy of the policy, without materialising fp32 `[B, T, V]`.

`token_logprobs(hidden, sequences, lm_head_weight=w)` takes the model's last hidden states and the LM
head weight; `token_logprobs(logits, sequences)` takes logits the model already produced (bf16, say);
`aligned=True` takes the targets instead of shifting (a CP slice or packed rows). It works `chunk` token
positions at a time: the logits of one chunk (`[chunk, V]`, and its fp32 temporaries under the `torch`
kernel) are the only vocabulary-sized tensors, in the forward *and* the backward pass (a custom autograd
function recomputes each chunk's logits in backward instead of saving them, and accumulates the LM head's
gradient chunk by chunk in fp32). Entropy comes from the same pass. The per-chunk math has three
implementations (`logprob_kernels.py`: torch, compile, triton; `auto` picks triton on CUDA GPUs). The
distribution is the sampling one, `softmax(logits / temperature)`, as the engines report it.

Alignment (see `experience.py`): the output is `[B, T]` at the token's own index — `logp[b, t]` is
log p(sequences[b, t] | hidden[b, t-1]) — and column 0, which nothing predicts, is 0. With the
action mask (`mask`), only action positions are computed (the rest are 0); prompts and env feedback cost
nothing. A hidden state at the last token of one packed sample predicts the first token of the
next: that token is a prompt token, never an action, so it is never used.
"""

import torch
from torch import Tensor

from molt_hpc.algorithm.logprob_kernels import check_kernel, compute_dtype, kernel_fns


class _ChunkedLogProbs(torch.autograd.Function):
    """(log p(target), entropy) for rows `source[idx]`: hidden states (with `weight`) or logits."""

    @staticmethod
    def forward(ctx, source, weight, idx, targets, temperature, chunk, kernel):
        n, dtype = idx.shape[0], compute_dtype((source if weight is None else weight).dtype)
        stats, _ = kernel_fns(kernel, dtype, source.device.type)
        logp, lse, mean_z = (torch.empty(n, dtype=dtype, device=source.device) for _ in range(3))
        spans = _spans(idx, chunk)
        for s, rows in spans:
            raw = _chunk_raw(source, weight, rows)
            part = slice(s, s + raw.shape[0])
            logp[part], lse[part], mean_z[part] = stats(raw, targets[part], temperature)
        ctx.save_for_backward(source, weight, targets, lse, mean_z)
        ctx.temperature, ctx.spans, ctx.kernel = temperature, spans, kernel
        ctx.set_materialize_grads(False)
        return logp, lse - mean_z

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        source, weight, targets, lse, mean_z = ctx.saved_tensors
        temperature = ctx.temperature
        _, grad_fn = kernel_fns(ctx.kernel, lse.dtype, lse.device.type)
        grad_src = torch.zeros_like(source) if ctx.needs_input_grad[0] else None
        grad_w = None
        if weight is not None and ctx.needs_input_grad[1]:
            grad_w = torch.zeros(weight.shape, dtype=lse.dtype, device=weight.device)  # accumulated in fp32
        if (g_logp is None and g_ent is None) or (weight is None and grad_src is None):
            return grad_src, _cast(grad_w, weight), None, None, None, None, None
        for s, rows in ctx.spans:
            raw = _chunk_raw(source, weight, rows)  # recomputed: no chunk of logits outlives its pass
            part = slice(s, s + raw.shape[0])
            gl = None if g_logp is None else g_logp[part]
            ge = None if g_ent is None else g_ent[part]
            if weight is None:
                # logits: straight into the gradient when the rows are one slice of it
                direct = isinstance(rows, slice)
                out = grad_src[rows] if direct else torch.empty_like(raw)
                dz = grad_fn(raw, lse[part], mean_z[part], targets[part], gl, ge, temperature, out)
                if not direct:
                    grad_src[rows] = dz
                continue
            # hidden states: the recomputed logits are a scratch chunk the gradient may overwrite
            dz = grad_fn(raw, lse[part], mean_z[part], targets[part], gl, ge, temperature, raw)
            if grad_src is not None:
                grad_src[rows] = (dz @ weight).to(source.dtype)
            if grad_w is not None:
                grad_w += (dz.t() @ source[rows].to(dz.dtype)).to(grad_w.dtype)
        return grad_src, _cast(grad_w, weight), None, None, None, None, None


def _cast(grad_w: Tensor | None, weight: Tensor | None) -> Tensor | None:
    return None if grad_w is None else grad_w.to(weight.dtype)


def _spans(idx: Tensor, chunk: int) -> list[tuple[int, slice | Tensor]]:
    """(offset, rows) per chunk of `idx` (increasing): a slice where the rows are consecutive, so no
    gather copies them, else the index tensor. One host sync per call."""
    n = idx.shape[0]
    if n == 0:
        return []
    starts = torch.arange(0, n, chunk, device=idx.device)
    ends = (starts + chunk).clamp_(max=n) - 1
    consecutive = (idx[ends] - idx[starts]) == (ends - starts)
    firsts = idx[starts]
    spans: list[tuple[int, slice | Tensor]] = []
    for s, first, whole in zip(range(0, n, chunk), firsts.tolist(), consecutive.tolist(), strict=True):
        m = min(chunk, n - s)
        spans.append((s, slice(first, first + m) if whole else idx[s : s + m]))
    return spans


def _chunk_raw(source: Tensor, weight: Tensor | None, rows) -> Tensor:
    """`[len(rows), V]` logits in the model's dtype: the LM head's matmul (as the model's own head runs
    it) of the rows' hidden states, or the rows of the given logits (a view where `rows` is a slice)."""
    x = source[rows]
    return x if weight is None else x.to(weight.dtype) @ weight.t()


def _positions(sequences: Tensor, action_mask: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """Flat source rows (position t-1), targets (token t) and the `[B, T-1]` selection of targets."""
    b, t = sequences.shape
    sel = torch.ones(b, t - 1, dtype=torch.bool, device=sequences.device)
    if action_mask is not None:
        sel = action_mask[:, 1:].to(torch.bool)
    bi, ti = sel.nonzero(as_tuple=True)
    return bi * t + ti, sequences[:, 1:][sel], sel


def _check(sequences: Tensor, temperature: float, chunk: int, kernel: str) -> None:
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk < 1:
        raise ValueError(f"chunk (actor.logprob_chunk) must be >= 1, got {chunk}")
    if sequences.dim() != 2:
        raise ValueError(f"sequences must be [B, T], got shape {tuple(sequences.shape)}")
    check_kernel(kernel, sequences.device)


def _scatter_back(flat: Tensor, sel: Tensor) -> Tensor:
    """`[n]` values of the selected targets -> `[B, T]`, 0 in column 0 and off the selection."""
    out = torch.zeros(sel.shape, dtype=flat.dtype, device=flat.device).masked_scatter(sel, flat)
    return torch.nn.functional.pad(out, (1, 0))


def _check_head(hidden: Tensor, weight: Tensor) -> None:
    if weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"lm_head_weight is {tuple(weight.shape)}, hidden size is {hidden.shape[-1]}")


def _target_rows(targets: Tensor, mask: Tensor | None, shape: tuple[int, int]) -> tuple[Tensor, Tensor, Tensor]:
    b, s = shape
    if targets.shape != (b, s):
        raise ValueError(f"targets are {tuple(targets.shape)}, the model's positions {(b, s)}")
    sel = torch.ones(b, s, dtype=torch.bool, device=targets.device) if mask is None else mask.to(torch.bool)
    bi, si = sel.nonzero(as_tuple=True)
    return bi * s + si, targets[sel], sel


def _at_index(sel: Tensor, logp: Tensor, ent: Tensor) -> tuple[Tensor, Tensor]:
    zeros = torch.zeros(sel.shape, dtype=logp.dtype, device=logp.device)
    return zeros.masked_scatter(sel, logp), zeros.masked_scatter(sel, ent)


def token_logprobs(
    source: Tensor,
    tokens: Tensor,
    *,
    lm_head_weight: Tensor | None = None,
    aligned: bool = False,
    mask: Tensor | None = None,
    temperature: float = 1.0,
    chunk: int = 1024,
    kernel: str = "auto",
) -> tuple[Tensor, Tensor]:
    """(log-prob of each token, entropy of the distribution that predicted it), both float32.

    `source` is the last hidden states `[B, T, H]` (after the final norm) with `lm_head_weight [V, H]`,
    gradients flowing to both (the head's accumulated over chunks in fp32; an LM head with a bias is not
    supported, no current model has one), or logits `[B, T, V]` the model already produced (any dtype;
    only `chunk` rows at a time go to fp32) when `lm_head_weight` is None.

    `tokens` are the sequences `[B, T]`: position t-1 predicts token t, the output is at the token's own
    index with column 0 at 0, and `mask` (the action mask, `[B, T]`) selects the tokens computed. With
    `aligned`, `tokens [B, S]` are the targets of each position instead (a CP slice of a row, whose last
    position predicts a token of the next slice; packed rows): `[B, S]` log p(tokens[b, j] | source[b, j])
    at the source's index, 0 off `mask [B, S]`. `kernel`: see `logprob_kernels`.
    """
    _check(tokens, temperature, chunk, kernel)
    b, t, width = source.shape
    if lm_head_weight is not None:
        _check_head(source, lm_head_weight)
    flat = source.reshape(b * t, width)
    if aligned:
        idx, picked, sel = _target_rows(tokens, mask, (b, t))
        logp, ent = _ChunkedLogProbs.apply(flat, lm_head_weight, idx, picked, temperature, chunk, kernel)
        return _at_index(sel, logp, ent)
    idx, targets, sel = _positions(tokens, mask)
    logp, ent = _ChunkedLogProbs.apply(flat, lm_head_weight, idx, targets, temperature, chunk, kernel)
    return _scatter_back(logp, sel), _scatter_back(ent, sel)


def exact_token_logprobs(
    source: Tensor,
    tokens: Tensor,
    *,
    lm_head_weight: Tensor | None = None,
    aligned: bool = False,
    mask: Tensor | None = None,
    temperature: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """`token_logprobs` as the engine computes its sampling log-probs under `engines.exact`, bit for bit.

    The LM head is `models.exact.exact_linear` (the engine's head on a model `make_exact` changed) and the
    log-probs `engine.sampling.processed_logprobs` (the engine's one function, the temperature a float32
    tensor per row as the engine holds it); the selected positions' logits are materialised whole (no
    chunks, no triton kernel: those reduce over the vocabulary in another order). Same arguments and
    outputs as `token_logprobs`.
    """
    from molt_hpc.engine.sampling import processed_logprobs
    from molt_hpc.models.exact_linear import exact_linear

    _check(tokens, temperature, 1, "torch")
    b, t, width = source.shape
    flat = source.reshape(b * t, width)
    if aligned:
        idx, picked, sel = _target_rows(tokens, mask, (b, t))
    else:
        idx, picked, sel = _positions(tokens, mask)
    rows = flat[idx]
    logits = rows if lm_head_weight is None else exact_linear(rows.to(lm_head_weight.dtype), lm_head_weight)
    n = logits.shape[0]
    temp = torch.full((n,), temperature, dtype=torch.float32)
    logp_all = processed_logprobs(logits, temp, torch.zeros(n, dtype=torch.long), torch.ones(n), torch.zeros(n))
    logp = logp_all.gather(-1, picked[:, None]).view(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    if aligned:
        return _at_index(sel, logp, ent)
    return _scatter_back(logp, sel), _scatter_back(ent, sel)
