"""Per-token log-probs and entropy of the policy, without materialising fp32 `[B, T, V]`.

`token_logprobs(hidden, lm_head_weight, sequences)` takes the model's last hidden states and the LM
head weight; `logprobs_from_logits(logits, sequences)` takes logits the model already produced (bf16,
say). Both work `chunk` token positions at a time: the fp32 logits of one chunk (`[chunk, V]`) are
the only vocabulary-sized temporary, in the forward *and* the backward pass (a custom autograd
function recomputes each chunk's logits in backward instead of saving them). The distribution is
the sampling one, `softmax(logits / temperature)`, as the engines report it.

Alignment (see `experience.py`): the output is `[B, T]` at the token's own index — `logp[b, t]` is
log p(sequences[b, t] | hidden[b, t-1]) — and column 0, which nothing predicts, is 0. With
`action_mask`, only action positions are computed (the rest are 0); prompts and env feedback cost
nothing. A hidden state at the last token of one packed sample predicts the first token of the
next: that token is a prompt token, never an action, so it is never used.
"""

import torch
from torch import Tensor


def _chunk_forward(z: Tensor, targets: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(log p(target), logsumexp, E_p[z]) of fp32 logits `z [n, V]`, which it may overwrite.

    One fused softmax gives p; lse = max - log p(argmax) + log sum(p) (p(argmax) >= 1/V never
    underflows), so no separate logsumexp pass is needed. Entropy is lse - E_p[z]."""
    top, arg = z.max(-1, keepdim=True)
    p = torch.softmax(z, -1)
    # softmax's own normaliser is summed less accurately than torch.sum on CPU: divide it out
    total = p.sum(-1)
    lse = (top - p.gather(1, arg).log_()).squeeze(1) + total.log()
    logp = z.gather(1, targets[:, None]).squeeze(1) - lse
    mean_z = p.mul_(z).sum(-1).div_(total)
    return logp, lse, mean_z


def _chunk_grad(
    z: Tensor, lse: Tensor, mean_z: Tensor, targets: Tensor, gl: Tensor | None, ge: Tensor | None, temp: float, out
) -> Tensor:
    """d/dx of `gl · log p_y + ge · H` for logits `z = x / temp`, written into `out` (any float dtype).

    d log p_y / dz = onehot(y) - p and dH / dz = -p (z - E_p[z]), so with per-row scalars
    a = -ge / temp and b = (ge E_p[z] - gl) / temp: dx = p (a z + b) + onehot(y) gl / temp.
    `z` is overwritten with p; the target column is fixed up in fp32 so `out` is rounded once."""
    gl = torch.zeros_like(lse) if gl is None else gl.to(z.dtype)
    b = (-gl if ge is None else ge.to(z.dtype) * mean_z - gl).div_(temp)[:, None]
    t = b if ge is None else torch.addcmul(b, z, ge.to(z.dtype)[:, None], value=-1.0 / temp)
    p = z.sub_(lse[:, None]).exp_()
    torch.mul(p, t, out=out)
    col = targets[:, None]
    t_y = t if ge is None else t.gather(1, col)
    at_y = p.gather(1, col).mul_(t_y).add_(gl[:, None], alpha=1.0 / temp)
    return out.scatter_(1, col, at_y.to(out.dtype))


class _ChunkedLogProbs(torch.autograd.Function):
    """(log p(target), entropy) for rows `source[idx]`: hidden states (with `weight`) or logits."""

    @staticmethod
    def forward(ctx, source, weight, idx, targets, temperature, chunk):
        n, dtype = idx.shape[0], _compute_dtype(source, weight)
        logp, lse, mean_z = (torch.empty(n, dtype=dtype, device=source.device) for _ in range(3))
        spans = _spans(idx, chunk)
        for s, rows in spans:
            z = _chunk_logits(source, weight, rows, temperature)
            part = slice(s, s + z.shape[0])
            logp[part], lse[part], mean_z[part] = _chunk_forward(z, targets[part])
        ctx.save_for_backward(source, weight, targets, lse, mean_z)
        ctx.temperature, ctx.spans = temperature, spans
        ctx.set_materialize_grads(False)
        return logp, lse - mean_z

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        source, weight, targets, lse, mean_z = ctx.saved_tensors
        temperature = ctx.temperature
        grad_src = torch.zeros_like(source) if ctx.needs_input_grad[0] else None
        grad_w = None
        if weight is not None and ctx.needs_input_grad[1]:
            grad_w = torch.zeros(weight.shape, dtype=lse.dtype, device=weight.device)  # accumulated in fp32
        for s, rows in ctx.spans if g_logp is not None or g_ent is not None else []:
            z = _chunk_logits(source, weight, rows, temperature)
            part = slice(s, s + z.shape[0])
            gl = None if g_logp is None else g_logp[part]
            ge = None if g_ent is None else g_ent[part]
            if weight is None and grad_src is None:
                continue
            # logits: straight into the gradient when the rows are one slice of it
            direct = weight is None and isinstance(rows, slice)
            out = (
                grad_src[rows]
                if direct
                else torch.empty_like(z, dtype=source.dtype if weight is None else weight.dtype)
            )
            dz = _chunk_grad(z, lse[part], mean_z[part], targets[part], gl, ge, temperature, out)
            if weight is None:
                if not direct:
                    grad_src[rows] = dz
                continue
            if grad_src is not None:
                grad_src[rows] = (dz @ weight).to(source.dtype)
            if grad_w is not None:
                grad_w += (dz.t() @ source[rows].to(dz.dtype)).to(grad_w.dtype)
        grad_w = grad_w.to(weight.dtype) if grad_w is not None else None
        return grad_src, grad_w, None, None, None, None


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


def _compute_dtype(source: Tensor, weight: Tensor | None) -> torch.dtype:
    """fp32 for bf16/fp16/fp32 models; fp64 stays fp64."""
    return torch.promote_types((source if weight is None else weight).dtype, torch.float32)


def _chunk_logits(source: Tensor, weight: Tensor | None, rows: Tensor, temperature: float) -> Tensor:
    """fp32 `[len(rows), V]` logits / temperature; the matmul runs in the model's dtype, as its LM head does."""
    x = source[rows]
    if weight is not None:
        x = x.to(weight.dtype) @ weight.t()
    z = x.to(_compute_dtype(source, weight), copy=True)  # a copy: callers overwrite it
    return z.div_(temperature) if temperature != 1.0 else z


def _positions(sequences: Tensor, action_mask: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """Flat source rows (position t-1), targets (token t) and the `[B, T-1]` selection of targets."""
    b, t = sequences.shape
    sel = torch.ones(b, t - 1, dtype=torch.bool, device=sequences.device)
    if action_mask is not None:
        sel = action_mask[:, 1:].to(torch.bool)
    bi, ti = sel.nonzero(as_tuple=True)
    return bi * t + ti, sequences[:, 1:][sel], sel


def _check(sequences: Tensor, temperature: float, chunk: int) -> None:
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk < 1:
        raise ValueError(f"chunk (actor.logprob_chunk) must be >= 1, got {chunk}")
    if sequences.dim() != 2:
        raise ValueError(f"sequences must be [B, T], got shape {tuple(sequences.shape)}")


def _scatter_back(flat: Tensor, sel: Tensor) -> Tensor:
    """`[n]` values of the selected targets -> `[B, T]`, 0 in column 0 and off the selection."""
    out = torch.zeros(sel.shape, dtype=flat.dtype, device=flat.device).masked_scatter(sel, flat)
    return torch.nn.functional.pad(out, (1, 0))


def token_logprobs(
    hidden: Tensor,
    lm_head_weight: Tensor,
    sequences: Tensor,
    *,
    temperature: float = 1.0,
    chunk: int = 1024,
    action_mask: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """(log-prob of each token, entropy of the distribution that predicted it), both `[B, T]` float32.

    `hidden [B, T, H]` are the last hidden states (after the final norm), `lm_head_weight [V, H]`;
    gradients flow to both. An LM head with a bias is not supported (no current model has one).
    """
    _check(sequences, temperature, chunk)
    b, t, h = hidden.shape
    if lm_head_weight.shape[1] != h:
        raise ValueError(f"lm_head_weight is {tuple(lm_head_weight.shape)}, hidden size is {h}")
    idx, targets, sel = _positions(sequences, action_mask)
    flat = hidden.reshape(b * t, h)
    logp, ent = _ChunkedLogProbs.apply(flat, lm_head_weight, idx, targets, temperature, chunk)
    return _scatter_back(logp, sel), _scatter_back(ent, sel)


def logprobs_from_logits(
    logits: Tensor,
    sequences: Tensor,
    *,
    temperature: float = 1.0,
    chunk: int = 1024,
    action_mask: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """As `token_logprobs`, from logits `[B, T, V]` (any dtype; only `chunk` rows at a time go to fp32)."""
    _check(sequences, temperature, chunk)
    b, t, v = logits.shape
    idx, targets, sel = _positions(sequences, action_mask)
    logp, ent = _ChunkedLogProbs.apply(logits.reshape(b * t, v), None, idx, targets, temperature, chunk)
    return _scatter_back(logp, sel), _scatter_back(ent, sel)


def target_logprobs(
    logits: Tensor,
    targets: Tensor,
    *,
    temperature: float = 1.0,
    chunk: int = 1024,
    mask: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """As `logprobs_from_logits`, with the targets given instead of shifted: `[B, S]` log p(targets[b, j]
    | logits[b, j]) and the entropy of that distribution, at the logits' index (0 off `mask`). For a
    slice of a row (context parallelism), whose last position predicts a token of the next slice."""
    _check(targets, temperature, chunk)
    b, s, v = logits.shape
    if targets.shape != (b, s):
        raise ValueError(f"targets are {tuple(targets.shape)}, logits {tuple(logits.shape)}")
    sel = torch.ones(b, s, dtype=torch.bool, device=targets.device) if mask is None else mask.to(torch.bool)
    bi, si = sel.nonzero(as_tuple=True)
    logp, ent = _ChunkedLogProbs.apply(logits.reshape(b * s, v), None, bi * s + si, targets[sel], temperature, chunk)
    zeros = torch.zeros(sel.shape, dtype=logp.dtype, device=logp.device)
    return zeros.masked_scatter(sel, logp), zeros.masked_scatter(sel, ent)
