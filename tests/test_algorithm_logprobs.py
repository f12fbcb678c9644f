"""Chunked log-probs and entropy against the naive full-vocabulary computation, values and gradients."""

import pytest
import torch

from molt_hpc.algorithm.logprobs import _spans, token_logprobs

B, T, H, V = 3, 7, 16, 50


def naive(logits: torch.Tensor, seqs: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """log_softmax(logits.float() / T) over the whole vocabulary, read at t-1 for token t."""
    logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)
    logp = logp_all[:, :-1].gather(2, seqs[:, 1:, None]).squeeze(2)
    ent = -(logp_all.exp() * logp_all).sum(-1)[:, :-1]
    pad = torch.zeros(logits.shape[0], 1)
    return torch.cat([pad, logp], 1), torch.cat([pad, ent], 1)


def inputs(dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g).to(dtype).requires_grad_(True)
    weight = (torch.randn(V, H, generator=g) * 0.5).to(dtype).requires_grad_(True)
    seqs = torch.randint(0, V, (B, T), generator=g)
    upstream = torch.randn(2, B, T, generator=g)
    return hidden, weight, seqs, upstream


def backward(logp, ent, upstream, mask=None):
    if mask is not None:
        upstream = upstream * mask
    ((logp * upstream[0]).sum() + (ent * upstream[1]).sum()).backward()


@pytest.mark.parametrize("chunk", [1, 4, 1024])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_hidden_states_path_matches_naive_fp32(chunk, temperature):
    hidden, weight, seqs, up = inputs(torch.float32)
    logp, ent = token_logprobs(hidden, seqs, lm_head_weight=weight, temperature=temperature, chunk=chunk)
    backward(logp, ent, up)
    got = (logp.detach(), ent.detach(), hidden.grad.clone(), weight.grad.clone())
    hidden.grad = weight.grad = None
    ref_logp, ref_ent = naive(hidden @ weight.t(), seqs, temperature)
    backward(ref_logp, ref_ent, up)
    for a, b in zip(got, (ref_logp, ref_ent, hidden.grad, weight.grad), strict=True):
        assert torch.allclose(a, b.detach(), atol=1e-5, rtol=0), (a - b).abs().max()


@pytest.mark.parametrize("use", ["logp", "entropy"])
def test_gradient_when_only_one_output_is_used(use):
    hidden, weight, seqs, _ = inputs(torch.float32, seed=7)
    logp, ent = token_logprobs(hidden, seqs, lm_head_weight=weight, temperature=0.9, chunk=4)
    (logp if use == "logp" else ent).sum().backward()
    got = (hidden.grad.clone(), weight.grad.clone())
    hidden.grad = weight.grad = None
    ref_logp, ref_ent = naive(hidden @ weight.t(), seqs, 0.9)
    (ref_logp if use == "logp" else ref_ent).sum().backward()
    assert torch.allclose(got[0], hidden.grad, atol=1e-5) and torch.allclose(got[1], weight.grad, atol=1e-5)


def test_action_mask_computes_only_action_positions():
    hidden, weight, seqs, up = inputs(torch.float32, seed=1)
    mask = torch.rand(B, T, generator=torch.Generator().manual_seed(2)) < 0.5
    logp, ent = token_logprobs(hidden, seqs, lm_head_weight=weight, temperature=0.9, chunk=3, mask=mask)
    backward(logp, ent, up, mask)
    got = (hidden.grad.clone(), weight.grad.clone())
    hidden.grad = weight.grad = None
    ref_logp, ref_ent = naive(hidden @ weight.t(), seqs, 0.9)
    on = mask.clone()
    on[:, 0] = False  # nothing predicts column 0
    assert torch.allclose(logp[on], ref_logp[on].detach(), atol=1e-5)
    assert torch.allclose(ent[on], ref_ent[on].detach(), atol=1e-5)
    assert (logp[~on] == 0).all() and (ent[~on] == 0).all()
    backward(ref_logp, ref_ent, up, on)
    assert torch.allclose(got[0], hidden.grad, atol=1e-5) and torch.allclose(got[1], weight.grad, atol=1e-5)


def test_gradcheck_float64():
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 4, 5, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(6, 5, dtype=torch.float64, generator=g, requires_grad=True)
    seqs = torch.randint(0, 6, (2, 4), generator=g)

    def f(h, w):
        return token_logprobs(h, seqs, lm_head_weight=w, temperature=0.8, chunk=3)

    assert torch.autograd.gradcheck(f, (hidden, weight), fast_mode=True)
    logits = torch.randn(2, 4, 6, dtype=torch.float64, generator=g, requires_grad=True)

    def from_logits(x):
        return token_logprobs(x, seqs, temperature=1.3, chunk=2)

    assert torch.autograd.gradcheck(from_logits, (logits,), fast_mode=True)


def test_bf16_model_matches_naive_on_its_own_logits():
    """bf16 hidden states and head: equal to log_softmax(bf16 logits .float() / T), the naive recipe."""
    hidden, weight, seqs, up = inputs(torch.bfloat16, seed=4)
    logp, ent = token_logprobs(hidden, seqs, lm_head_weight=weight, temperature=0.6, chunk=5)
    backward(logp, ent, up)
    got = (hidden.grad.float(), weight.grad.float())
    hidden.grad = weight.grad = None
    ref_logp, ref_ent = naive(hidden @ weight.t(), seqs, 0.6)
    assert logp.dtype == torch.float32
    assert torch.allclose(logp, ref_logp.detach(), atol=1e-5) and torch.allclose(ent, ref_ent.detach(), atol=1e-5)
    backward(ref_logp, ref_ent, up)
    # gradients are bf16 on both sides; fp32 accumulation of the head gradient differs by bf16 rounding
    for a, b in zip(got, (hidden.grad.float(), weight.grad.float()), strict=True):
        assert torch.allclose(a, b, atol=2e-2, rtol=2e-2), (a - b).abs().max()


def test_logits_path_matches_naive_with_bf16_logits():
    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(B, T, V, generator=g) * 3).to(torch.bfloat16).requires_grad_(True)
    seqs = torch.randint(0, V, (B, T), generator=g)
    up = torch.randn(2, B, T, generator=g)
    logp, ent = token_logprobs(logits, seqs, temperature=0.7, chunk=4)
    backward(logp, ent, up)
    got = logits.grad.float()
    logits.grad = None
    ref_logp, ref_ent = naive(logits, seqs, 0.7)
    assert torch.allclose(logp, ref_logp.detach(), atol=1e-5) and torch.allclose(ent, ref_ent.detach(), atol=1e-5)
    backward(ref_logp, ref_ent, up)
    assert torch.allclose(got, logits.grad.float(), atol=1e-2, rtol=1e-2)


def saved_shapes(fn) -> list[torch.Size]:
    """Shapes of every tensor autograd keeps for the backward pass while `fn` runs."""
    shapes: list[torch.Size] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(t.shape) or t, lambda t: t):
        fn()
    return shapes


def test_no_vocabulary_sized_tensor_is_kept_for_backward():
    hidden, weight, seqs, _ = inputs(torch.float32, seed=6)
    naive_saved = saved_shapes(lambda: naive(hidden @ weight.t(), seqs, 1.0))
    assert any(s == (B, T, V) for s in naive_saved)  # the hook sees what the naive recipe keeps
    ours = saved_shapes(lambda: token_logprobs(hidden, seqs, lm_head_weight=weight, chunk=4))
    # hidden states, the head weight and per-token scalars only
    assert max(s.numel() for s in ours) <= max(hidden.numel(), weight.numel())


def test_bad_arguments():
    hidden, weight, seqs, _ = inputs(torch.float32)
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(hidden, seqs, lm_head_weight=weight, temperature=0.0)
    with pytest.raises(ValueError, match="chunk"):
        token_logprobs(hidden, seqs, lm_head_weight=weight, chunk=0)
    with pytest.raises(ValueError, match="hidden size"):
        token_logprobs(hidden, seqs, lm_head_weight=weight[:, :3])


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("use", ["both", "logp", "entropy"])
def test_logits_path_fp32_slices_and_gathers(masked, use):
    """Unmasked rows are read and written as slices of the logits (no gather); masked rows are gathered.
    Either way: equal to the naive recipe, and the caller's logits are left untouched."""
    g = torch.Generator().manual_seed(8)
    logits = (torch.randn(B, T, V, generator=g) * 2).requires_grad_(True)
    before = logits.detach().clone()
    seqs = torch.randint(0, V, (B, T), generator=g)
    up = torch.randn(2, B, T, generator=g)
    mask = (torch.rand(B, T, generator=g) < 0.6) if masked else torch.ones(B, T, dtype=torch.bool)
    mask[:, 0] = False
    if use == "logp":
        up[1] = 0
    if use == "entropy":
        up[0] = 0
    logp, ent = token_logprobs(logits, seqs, temperature=1.0, chunk=4, mask=mask if masked else None)
    assert torch.equal(logits.detach(), before)
    if use == "logp":
        (logp * up[0] * mask).sum().backward()
    elif use == "entropy":
        (ent * up[1] * mask).sum().backward()
    else:
        backward(logp, ent, up, mask)
    got = logits.grad.clone()
    logits.grad = None
    ref_logp, ref_ent = naive(logits, seqs, 1.0)
    assert torch.allclose(logp[mask], ref_logp[mask].detach(), atol=1e-5)
    assert torch.allclose(ent[mask], ref_ent[mask].detach(), atol=1e-5)
    backward(ref_logp, ref_ent, up, mask)
    assert torch.allclose(got, logits.grad, atol=1e-5, rtol=0), (got - logits.grad).abs().max()


def test_peaked_distribution_where_target_probability_underflows():
    """Logits spread over hundreds of nats: p(target) is 0 in fp32, log p(target) must still be exact."""
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(1, 6, V, generator=g) * 60
    seqs = torch.randint(0, V, (1, 6), generator=g)
    logp, ent = token_logprobs(logits, seqs, chunk=2)
    all64 = torch.log_softmax(logits.double(), -1)[:, :-1]
    ref_logp = all64.gather(2, seqs[:, 1:, None]).squeeze(2)
    ref_ent = -(all64.exp() * all64).sum(-1)
    assert (ref_logp < -110).any()  # exp of it is below fp32's smallest subnormal
    assert torch.allclose(logp[:, 1:].double(), ref_logp, atol=1e-5, rtol=1e-6)
    # entropy = lse - E_p[z] cancels: its error is bounded by fp32 rounding of the logits' magnitude
    ulp_scale = torch.finfo(torch.float32).eps * logits.abs().max().item()
    assert torch.allclose(ent[:, 1:].double(), ref_ent, atol=ulp_scale), (ent[:, 1:] - ref_ent).abs().max()


def test_wide_vocabulary_matches_float64():
    """A 32k vocabulary: the normaliser summed over many terms keeps log-probs and entropy within 1e-5."""
    g = torch.Generator().manual_seed(11)
    logits = (torch.randn(1, 9, 32000, generator=g) * 3).to(torch.bfloat16)
    seqs = torch.randint(0, 32000, (1, 9), generator=g)
    logp, ent = token_logprobs(logits, seqs, temperature=0.7, chunk=4)
    all64 = torch.log_softmax(logits.double() / 0.7, -1)[:, :-1]
    assert torch.allclose(logp[:, 1:].double(), all64.gather(2, seqs[:, 1:, None]).squeeze(2), atol=1e-5, rtol=0)
    assert torch.allclose(ent[:, 1:].double(), -(all64.exp() * all64).sum(-1), atol=1e-5, rtol=0)


def test_gradcheck_float64_single_outputs_and_mask():
    g = torch.Generator().manual_seed(10)
    logits = torch.randn(2, 5, 7, dtype=torch.float64, generator=g, requires_grad=True)
    seqs = torch.randint(0, 7, (2, 5), generator=g)
    mask = torch.tensor([[0, 1, 1, 0, 1], [0, 1, 1, 1, 1]], dtype=torch.bool)
    for out in (0, 1):

        def f(x, out=out):
            return token_logprobs(x, seqs, temperature=0.6, chunk=2, mask=mask)[out]

        assert torch.autograd.gradcheck(f, (logits,), fast_mode=True)


def test_spans_are_slices_only_where_rows_are_consecutive():
    idx = torch.tensor([0, 1, 2, 4, 5, 6, 7, 9])
    spans = _spans(idx, 3)
    assert [s for s, _ in spans] == [0, 3, 6]
    assert spans[0][1] == slice(0, 3) and spans[1][1] == slice(4, 7)
    assert torch.equal(spans[2][1], torch.tensor([7, 9]))
    assert _spans(idx[:0], 3) == []
