"""A vLLM teacher on one GPU (`make test-gpu`): `vllm serve` of a causal LM behind the teacher's front answers
`/logprobs` (and its top tokens) from vLLM's prompt log-probs as transformers computes them.

The teacher is the tiny model's spec with 2 heads (head size 64, where FlashAttention's kernels start) at
4 layers, served in bfloat16; the expected values are transformers' on the same GPU in float32. Skipped
without a GPU or without vLLM.
"""

import asyncio
import json

import pytest
import torch

from tests.conftest import vllm_gpu_marks
from tests.test_distill import SEQS, SPANS, post
from tests.test_engine_procs import make_run, spawn, wait_registered

pytestmark = vllm_gpu_marks()


def gpu_rows(path) -> list[torch.Tensor]:
    """Per sequence, `[span tokens, V]` float32 log-probs on the GPU at each span token's position."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32).cuda().eval()
    out = []
    with torch.no_grad():
        for seq, rs in zip(SEQS, SPANS, strict=True):
            logp = torch.log_softmax(model(input_ids=torch.tensor([seq], device="cuda")).logits[0].float(), dim=-1)
            out.append(logp[[t - 1 for a, b in rs for t in range(a, b)]].cpu())
    return out


def test_vllm_teaches_as_transformers(tmp_path) -> None:
    from molt_hpc.config.model import TinyModelConfig
    from molt_hpc.models import build_tiny

    base = build_tiny(tmp_path / "tiny", TinyModelConfig(num_heads=2))
    teacher = build_tiny(tmp_path / "teacher", TinyModelConfig(num_heads=2, num_layers=4, init_seed=3))
    run = make_run(tmp_path, "vllm-teacher", base, f"distill.teacher={json.dumps(str(teacher))}", "distill.kind='vllm'",
                   "distill.dtype='bfloat16'", "distill.device='cuda'", "distill.gpu_memory_utilization=0.3",
                   "distill.extra_args=['--enforce-eager']")  # fmt: skip
    p = wait_registered(run, spawn(run, "teacher", env={"CUDA_VISIBLE_DEVICES": "0"}), "teacher-0", timeout=900)
    try:
        status, answer = asyncio.run(post(p.url, {"input": SEQS, "ranges": SPANS, "top_k": 3}, run.token()))
        assert status == 200, answer
        items = sorted(answer["data"], key=lambda d: d["index"])
        for item, rows, seq, rs in zip(items, gpu_rows(teacher), SEQS, SPANS, strict=True):
            actual = [seq[t] for a, b in rs for t in range(a, b)]
            want = [float(rows[j, i]) for j, i in enumerate(actual)]
            assert item["logprobs"] == pytest.approx(want, abs=0.05, rel=0.02)  # bfloat16 against float32
            # the top tokens: 3 per position, their log-probs descending and the float32 ones of those ids, the
            # first within bfloat16's rounding of the float32 maximum (near-ties may order them otherwise)
            for j, (ids, lps) in enumerate(zip(item["top_ids"], item["top_logprobs"], strict=True)):
                assert len(ids) == 3 and lps == sorted(lps, reverse=True)
                assert lps == pytest.approx([float(rows[j, i]) for i in ids], abs=0.05, rel=0.02)
                assert lps[0] >= float(rows[j].max()) - 0.05
        assert asyncio.run(post(p.url, {"input": SEQS, "ranges": SPANS}, None))[0] == 401
    finally:
        p.stop()
