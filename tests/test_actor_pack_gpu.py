"""Packed rows on one GPU: the kernels that only run there (`make test-gpu`).

bf16 `sdpa` packs through torch's varlen flash kernel, `flash_attention_2` through flash-attn's (skipped
without the package), fp32 through SDPA one sample at a time. Their log-probs and gradients are
compared with an fp32 model on one sample per padded row: packed bf16 must be as close to it as padded
bf16 is (the same rounding, no attention across samples); packed fp32 equal to 1e-5.
"""

import copy

import pytest
import torch

from molt_hpc.actor.batch import policy_logprobs
from molt_hpc.actor.packing import packed
from molt_hpc.algorithm import experience_from_groups, token_logprobs
from molt_hpc.parallel.attention import DocumentAttention, attention_setup, use_document_attention
from tests.test_actor_cp import groups

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
V = 61


def _model(attn: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=V, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                         num_attention_heads=8, num_key_value_heads=2, initializer_range=0.1,
                         use_sliding_window=False)  # fmt: skip
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    model.config._attn_implementation = attn
    return model.to("cuda", dtype).train()


def _padded(model, exp):
    logits = model(input_ids=exp.sequences, position_ids=exp.position_ids, use_cache=False).logits
    return token_logprobs(logits, exp.sequences, mask=exp.action_mask)[0]


def _packed(model, exp, attn: str):
    """The whole batch (on the host, as the trainer packs it) in one packed row through `model`."""
    use_document_attention(model, DocumentAttention(attn, torch.device("cuda")))
    mb = packed(exp, torch.arange(exp.sequences.shape[0]))
    lp, _ = policy_logprobs(model, mb.batch.to("cuda"), 1.0, chunk=64)
    out = torch.zeros(exp.sequences.shape, device="cuda", dtype=lp.dtype)
    have = mb.src_row >= 0
    out[mb.src_row[have].cuda(), mb.src_col[have].cuda()] = lp[have.cuda()]  # `put`, keeping the graph
    return out, attention_setup(model).kernel


def _grads(model, lp, mask):
    model.zero_grad(set_to_none=True)
    lp[mask].sum().backward()
    return torch.cat([p.grad.float().flatten() for p in model.parameters()])


@pytest.mark.parametrize("attn", ["sdpa", "flash_attention_2"])
def test_packed_bf16_is_as_close_to_fp32_as_padded_bf16(attn) -> None:
    if attn == "flash_attention_2":
        pytest.importorskip("flash_attn")
    exp = experience_from_groups(groups(4, 4, seed=3), max_len=64, pad_id=0)
    on_gpu = exp.to("cuda")
    mask = on_gpu.action_mask
    ref = _model("sdpa", torch.float32)
    want = _padded(ref, on_gpu)
    g_want = _grads(ref, want, mask)
    pad_model = _model(attn, torch.bfloat16)
    pad = _padded(pad_model, on_gpu)
    g_pad = _grads(pad_model, pad, mask)
    pack_model = copy.deepcopy(pad_model)
    got, kernel = _packed(pack_model, exp, attn)
    assert kernel == ("varlen" if attn == "sdpa" else "flash_attention_2")
    g_got = _grads(pack_model, got, mask)
    err_pad, err_got = (pad - want)[mask].abs(), (got - want)[mask].abs()
    assert err_got.mean() <= 2 * err_pad.mean() + 1e-4, (err_got.mean(), err_pad.mean())
    assert err_got.max() <= 2 * err_pad.max() + 1e-3, (err_got.max(), err_pad.max())
    rel_pad, rel_got = ((g - g_want).norm() / g_want.norm() for g in (g_pad, g_got))
    assert rel_got <= 2 * rel_pad + 1e-3, (rel_got, rel_pad)


def test_packed_fp32_on_a_gpu_equals_padded() -> None:
    exp = experience_from_groups(groups(4, 4, seed=3), max_len=64, pad_id=0)
    ref = _model("sdpa", torch.float32)
    want = _padded(ref, exp.to("cuda"))
    got, kernel = _packed(copy.deepcopy(ref), exp, "sdpa")
    assert kernel == "varlen"  # chosen for sdpa on CUDA; fp32 falls back to SDPA a sample at a time
    mask = exp.action_mask.cuda()
    assert torch.allclose(got[mask], want[mask], atol=1e-5, rtol=0), (got - want)[mask].abs().max()
