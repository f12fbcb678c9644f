"""A vLLM 0.26 scorer on one GPU (`make test-gpu`): `vllm serve` takes a reward checkpoint as `molt-hpc
rm train` writes it (`Qwen3ForSequenceClassification`, one label, `problem_type = "regression"`) as a
classify model, behind our token-checking front, and scores token ids as transformers does.

The model is the tiny one with 2 heads (head size 64, where FlashAttention's kernels start) and a fresh
score head, served in bfloat16; the expected scores are transformers' on the same GPU in float32.
Skipped without a GPU or without vLLM.
"""

import asyncio
import json

import aiohttp
import pytest

from tests.conftest import vllm_gpu_marks
from tests.test_engine_procs import make_run, spawn, wait_registered
from tests.test_scorer import SEQS, build_reward_dir

pytestmark = vllm_gpu_marks()


async def classify(url: str, token: str | None, body: dict) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with aiohttp.ClientSession() as s, s.post(url + "/classify", json=body, headers=headers) as r:
        return r.status, await r.json(content_type=None)


def test_vllm_serves_our_reward_checkpoint(tmp_path) -> None:
    import torch
    from transformers import AutoModelForSequenceClassification

    from molt_hpc.config.model import TinyModelConfig
    from molt_hpc.models import build_tiny

    base = build_tiny(tmp_path / "tiny", TinyModelConfig(num_heads=2))
    rm = build_reward_dir(tmp_path / "rm", base, seed=11)
    run = make_run(tmp_path, "vllm-scorer", base, f"reward_model.path={json.dumps(str(rm))}",
                   "reward_model.kind='vllm'", "reward_model.dtype='bfloat16'", "reward_model.device='cuda'",
                   "reward_model.gpu_memory_utilization=0.3", "reward_model.max_model_len=256",
                   "reward_model.extra_args=['--enforce-eager']")  # fmt: skip
    p = wait_registered(run, spawn(run, "scorer", env={"CUDA_VISIBLE_DEVICES": "0"}), "scorer-0", timeout=900)
    try:
        status, answer = asyncio.run(classify(p.url, run.token(), {"input": SEQS}))
        assert status == 200, answer
        got = [d["probs"][0] for d in sorted(answer["data"], key=lambda d: d["index"])]
        model = AutoModelForSequenceClassification.from_pretrained(rm, local_files_only=True).cuda().eval()
        with torch.no_grad():
            want = [float(model(input_ids=torch.tensor([s], device="cuda")).logits[0, 0]) for s in SEQS]
        assert got == pytest.approx(want, abs=0.03, rel=0.02), (got, want)  # bfloat16 against float32
        assert asyncio.run(classify(p.url, None, {"input": SEQS}))[0] == 401
    finally:
        p.stop()
