"""Log-probs and entropy from hidden states, chunked, against the naive full-logits recipe (fp32, 1e-5).

- the trainer's forward (`policy_logprobs` under FSDP2, a gloo world of one in a spawned process):
  log-probs, entropy and the gradient of every parameter equal those of `log_softmax` over the full
  logits of an unsharded copy, for untied and tied heads, padded and packed rows; the LM head only
  ever computes one position per row;
- gradient clipping on the local shards equals torch's `clip_grad_norm_` on the same DTensor gradients;
- the chunk kernels (`torch`, `triton` under Triton's CPU interpreter, `compile`) give the same values
  and gradients at a temperature, with chunks that cut through rows and a mask.
"""

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT
from tests.ranks import spawn_ranks

VOCAB, TEMP = 97, 0.7


def _model(tied: bool):
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied,
                         max_position_embeddings=128, pad_token_id=0)  # fmt: skip
    torch.manual_seed(1)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa").eval()


def _trajectories():
    from molt_hpc.trajectory import Trajectory

    g = torch.Generator().manual_seed(0)
    out = []
    for prompt, action in [(5, 9), (3, 4), (6, 11), (2, 7)]:
        tokens = torch.randint(1, VOCAB, (prompt + action,), generator=g).tolist()
        out.append(Trajectory(tokens, prompt, [(prompt, prompt + action)], [0.0] * action, [0] * action, 1.0))
    return out


def _weights(exp) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token loss weights that depend on the token and its position only (the same in any layout)."""
    a = torch.sin(exp.sequences.double() * 0.37 + exp.position_ids.double()).float()
    return a, torch.cos(exp.position_ids.double() * 0.5).float()


def _naive(model, exp) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample log-probs, entropies (padded rows, one sample each) and the loss, from full logits."""
    logits = model(input_ids=exp.sequences, position_ids=exp.position_ids, use_cache=False).logits
    logp_all = torch.log_softmax(logits[:, :-1].double() / TEMP, -1)
    logp = torch.nn.functional.pad(logp_all.gather(2, exp.sequences[:, 1:, None]).squeeze(2), (1, 0))
    ent = torch.nn.functional.pad(-(logp_all.exp() * logp_all).sum(-1), (1, 0))
    return logp, ent


def _loss(exp, logp, ent) -> torch.Tensor:
    a, b = _weights(exp)
    m = exp.action_mask
    return (a[m].double() * logp[m].double()).sum() + (b[m].double() * ent[m].double()).sum()


def _per_sample(exp, values):
    return [values[(exp.seq_index == n) & exp.action_mask].double().tolist() for n in range(exp.num_samples)]


def _worker(_rank: int, out: str) -> None:
    import copy

    from molt_hpc.actor.batch import policy_logprobs
    from molt_hpc.actor.head import FUSED_OK
    from molt_hpc.actor.weights import full_tensor
    from molt_hpc.actor.world import init_world
    from molt_hpc.algorithm import make_experience
    from molt_hpc.config.train import ActorConfig
    from molt_hpc.parallel import parallelize
    from molt_hpc.parallel.attention import DocumentAttention

    torch.set_num_threads(1)
    cfg = ActorConfig(device="cpu")
    world = init_world(cfg)
    trajs = _trajectories()
    padded = make_experience(trajs, max_len=32)
    results = {}
    for tied in (False, True):
        for layout in ("padded", "packed"):
            base = _model(tied)
            ref = copy.deepcopy(base)
            want_lp, want_ent = _naive(ref, padded)
            _loss(padded, want_lp, want_ent).backward()
            want_grads = {n: p.grad.double() for n, p in ref.named_parameters()}
            exp = padded if layout == "padded" else make_experience(trajs, max_len=64, pack=True)
            docs = DocumentAttention("sdpa", world.device) if layout == "packed" else None
            model = parallelize(base.train(), world.mesh, cfg, documents=docs)
            widths: list[int] = []
            model.lm_head.register_forward_hook(lambda _m, _a, o, seen=widths: seen.append(o.shape[1]))
            logp, ent = policy_logprobs(model, exp, TEMP, chunk=5)
            _loss(exp, logp, ent).backward()
            grads = {n: full_tensor(p.grad.detach(), None)[0].double() for n, p in model.named_parameters()}
            clip = _clip_gap(model)
            results[f"{'tied' if tied else 'untied'}-{layout}"] = {
                "fused": getattr(model, FUSED_OK, None),
                "head_widths": widths,
                "logp": [_gap(x, y) for x, y in zip(_per_sample(exp, logp), _per_sample(padded, want_lp), strict=True)],
                "ent": [_gap(x, y) for x, y in zip(_per_sample(exp, ent), _per_sample(padded, want_ent), strict=True)],
                "grads": {n: _rel(g, want_grads[n]) for n, g in grads.items()},
                "names": sorted(grads) == sorted(want_grads),
                "clip": clip,
            }  # fmt: skip
    Path(out).write_text(json.dumps(results))
    torch.distributed.destroy_process_group()


def _clip_gap(model) -> list[float]:
    """(norm gap, clipped-gradient gap) of the local-shard clip against torch's on the same DTensor grads."""
    from molt_hpc.actor.clip import clip_grad_norm
    from molt_hpc.actor.weights import full_tensor

    params = [p for p in model.parameters() if p.grad is not None]
    saved = [p.grad.detach().clone() for p in params]
    norm = clip_grad_norm(params, 0.05)
    ours = [full_tensor(p.grad, None)[0].clone() for p in params]
    for p, g in zip(params, saved, strict=True):
        p.grad = g
    want = torch.nn.utils.clip_grad_norm_(params, 0.05).full_tensor()
    theirs = [full_tensor(p.grad, None)[0] for p in params]
    return [
        abs(norm - float(want)) / float(want),
        max(float((a - b).abs().max()) for a, b in zip(ours, theirs, strict=True)),
    ]


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def _gap(x: list[float], y: list[float]) -> float:
    assert len(x) == len(y)
    return max((abs(a - b) for a, b in zip(x, y, strict=True)), default=0.0)


def test_trainer_forward_from_hidden_states_equals_full_logits(tmp_path):
    out = tmp_path / "results.json"
    spawn_ranks(_worker, (str(out),), 1)  # raises if the worker failed
    results = json.loads(out.read_text())
    assert sorted(results) == ["tied-packed", "tied-padded", "untied-packed", "untied-padded"]
    for case, r in results.items():
        assert r["fused"] is True, f"{case}: the trainer fell back to full logits"
        assert r["head_widths"] and set(r["head_widths"]) == {1}, f"{case}: the LM head computed {r['head_widths']}"
        assert max(r["logp"]) < 1e-5 and max(r["ent"]) < 1e-5, (case, r["logp"], r["ent"])
        assert r["names"]
        assert r["clip"][0] < 1e-6 and r["clip"][1] < 1e-7, f"{case}: the clip differs from torch's: {r['clip']}"
        worst = max(r["grads"], key=r["grads"].get)
        assert r["grads"][worst] < 1e-5, (case, worst, r["grads"][worst])


def _kernel_case(kernel: str, dtype=torch.float32):
    from molt_hpc.algorithm import token_logprobs

    g = torch.Generator().manual_seed(3)
    hid = torch.randn(3, 11, 16, generator=g, dtype=dtype).requires_grad_()
    w = (torch.randn(VOCAB, 16, generator=g) * 0.7).to(dtype).requires_grad_()
    seqs = torch.randint(0, VOCAB, (3, 11), generator=g)
    mask = torch.rand(3, 11, generator=g) > 0.3
    ga, gb = torch.randn(3, 11, generator=g), torch.randn(3, 11, generator=g)
    logp, ent = token_logprobs(hid, seqs, lm_head_weight=w, temperature=TEMP, chunk=4, mask=mask, kernel=kernel)
    tl, te = token_logprobs(
        hid, seqs, lm_head_weight=w, aligned=True, temperature=TEMP, chunk=7, mask=mask, kernel=kernel
    )
    ((logp * ga).sum() + (ent * gb).sum() + (tl * gb).sum()).backward()
    return [x.detach().double() for x in (logp, ent, tl, te, hid.grad, w.grad)]


def test_torch_kernel_equals_naive():
    """The reference the other kernels are compared with, against log_softmax in fp64."""
    got = _kernel_case("torch", torch.float64)
    g = torch.Generator().manual_seed(3)
    hid = torch.randn(3, 11, 16, generator=g, dtype=torch.float64).requires_grad_()
    w = (torch.randn(VOCAB, 16, generator=g) * 0.7).double().requires_grad_()
    seqs = torch.randint(0, VOCAB, (3, 11), generator=g)
    mask = torch.rand(3, 11, generator=g) > 0.3
    ga, gb = torch.randn(3, 11, generator=g), torch.randn(3, 11, generator=g)
    lp_all = torch.log_softmax(hid @ w.t() / TEMP, -1)
    lp = lp_all[:, :-1].gather(2, seqs[:, 1:, None]).squeeze(2) * mask[:, 1:]
    ent = -(lp_all.exp() * lp_all).sum(-1)[:, :-1] * mask[:, 1:]
    tl = lp_all.gather(2, seqs[:, :, None]).squeeze(2) * mask
    te = -(lp_all.exp() * lp_all).sum(-1) * mask
    ((lp * ga[:, 1:]).sum() + (ent * gb[:, 1:]).sum() + (tl * gb).sum()).backward()
    for mine, want in zip(got[:4], [lp, ent, tl, te], strict=True):
        width = want.shape[1]
        assert torch.allclose(mine[:, -width:], want, atol=1e-10)
    assert torch.allclose(got[4], hid.grad, atol=1e-10) and torch.allclose(got[5], w.grad, atol=1e-10)


def _check_kernel_matches(kernel: str) -> None:
    want, got = _kernel_case("torch"), _kernel_case(kernel)
    for name, a, b in zip(["logp", "ent", "target logp", "target ent", "grad hidden", "grad head"], got, want,
                          strict=True):  # fmt: skip
        scale = max(1.0, float(b.abs().max()))
        assert float((a - b).abs().max()) <= 1e-5 * scale, (kernel, name, float((a - b).abs().max()))
        assert not math.isnan(float(a.sum()))


@pytest.mark.skipif(__import__("importlib").util.find_spec("triton") is None, reason="needs the triton package")
def test_triton_kernel_equals_torch_in_the_interpreter():
    """The Triton kernels run on the CPU under TRITON_INTERPRET=1 (set before triton compiles them)."""
    code = "from tests.test_fused_logprobs import _check_kernel_matches as c; c('triton')"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.slow
def test_compiled_kernel_equals_torch():
    _check_kernel_matches("compile")


def test_triton_kernel_is_refused_on_a_cpu_trainer():
    from molt_hpc.algorithm.logprob_kernels import check_kernel

    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the interpreter runs Triton on the CPU")
    with pytest.raises(ValueError, match="runs on CUDA GPUs"):
        check_kernel("triton", torch.device("cpu"))


def test_auto_kernel_is_triton_on_cuda_with_triton_and_torch_elsewhere():
    from molt_hpc.algorithm import logprob_kernels as lk

    has_triton = importlib.util.find_spec("triton") is not None
    assert lk.resolve_kernel("auto", "cpu") == "torch"
    assert lk.resolve_kernel("auto", "cuda") == ("triton" if has_triton else "torch")
    assert lk.resolve_kernel("compile", "cuda") == "compile"
    assert lk.kernel_fns("auto", torch.float32, "cpu") == (lk.torch_stats, lk.torch_grad)
    lk.check_kernel("auto", torch.device("cpu"))  # `auto` runs anywhere
