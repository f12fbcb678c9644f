"""The engine on a GPU (one GPU) and the refit over NCCL (two GPUs) (`make test-gpu`).

With two GPUs the engine runs on GPU 1 and the sender (a plain process, as trainer rank 0 would be)
on GPU 0: NCCL needs one GPU per rank. Same checks as on CPU, with the tolerance of two GPUs'
kernels. (One GPU for both: test_onegpu_gpu.py.)
"""

import asyncio
import random

import aiohttp
import pytest
import torch

from molt_hpc.config.infra import RefitConfig
from molt_hpc.engine.batch import ModelRunner
from molt_hpc.engine.client import generate
from molt_hpc.engine.sampling import processed_logprobs
from molt_hpc.models import load_causal_lm
from molt_hpc.refit import RefitSender
from tests.test_engine_pool import PROMPT, engine_logprobs, max_diff, perturbed
from tests.test_engine_procs import arun, make_run, spawn, wait_registered

pytestmark = pytest.mark.gpu


def gpu_logprobs(model) -> list[float]:
    logits, _ = ModelRunner(model, torch.device("cuda", 0)).prefill([PROMPT])
    ones = torch.ones(1, device="cuda")
    zeros = torch.zeros(1, device="cuda")
    return processed_logprobs(logits, ones, zeros.long(), ones, zeros)[0].tolist()


@pytest.fixture(scope="module")
def gpu_engine(tmp_path_factory, tiny_model_dir):
    """An engine on the last GPU (GPU 1 of two: the sender keeps GPU 0, NCCL needs one GPU per rank)."""
    run = make_run(
        tmp_path_factory.mktemp("gpu"), "gpu", tiny_model_dir, "engines.device='cuda'", "refit.host='127.0.0.1'"
    )
    gpu = str(min(torch.cuda.device_count(), 2) - 1)
    engine = wait_registered(run, spawn(run, "engine", 0, env={"CUDA_VISIBLE_DEVICES": gpu}), "engine-0", timeout=300)
    yield run, engine
    engine.stop()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_engine_on_gpu_samples_what_its_model_gives(gpu_engine, tiny_model_dir) -> None:
    run, engine = gpu_engine
    token = run.token()
    rng = random.Random(0)
    prompts = [[rng.randrange(4, 104) for _ in range(n)] for n in (3, 11, 29, 7)]
    sp = {"max_tokens": 24, "ignore_eos": True, "temperature": 0.9, "top_p": 0.95}

    async def batch():
        async with aiohttp.ClientSession() as s:
            return await asyncio.gather(*[generate(s, engine.url, p, sp, token=token) for p in prompts])

    outs = arun(batch())
    ref = load_causal_lm(tiny_model_dir, device="cuda")
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            logits = ref(torch.tensor([prompt + out.token_ids], device="cuda")).logits[0, len(prompt) - 1 : -1]
        n = len(out.token_ids)
        full = processed_logprobs(
            logits,
            torch.full((n,), 0.9, device="cuda"),
            torch.zeros(n, dtype=torch.long, device="cuda"),
            torch.full((n,), 0.95, device="cuda"),
            torch.zeros(n, device="cuda"),
        )
        want = full.gather(-1, torch.tensor(out.token_ids, device="cuda")[:, None]).view(-1).cpu()
        assert (want - torch.tensor(out.logprobs)).abs().max() < 1e-4


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (NCCL: one GPU per rank)")
def test_refit_over_nccl(gpu_engine, tiny_model_dir) -> None:
    run, engine = gpu_engine
    token = run.token()
    ref = load_causal_lm(tiny_model_dir, device="cuda")
    new = perturbed(tiny_model_dir, seed=1).to("cuda")
    sender = RefitSender(run.path, RefitConfig(bucket_mb=1, host="127.0.0.1"), token, device="cuda")
    assert sender.backend == "nccl"
    sender.connect([engine.url])
    assert sender.transports == {engine.url: "nccl"}, "another GPU: NCCL"
    stats = sender.push(new.named_parameters(), version=3)

    async def after():
        async with aiohttp.ClientSession() as s:
            return await engine_logprobs(s, engine.url, token)

    got, version = arun(after())
    assert version == 3 and stats.buckets >= 2
    assert max_diff(got, gpu_logprobs(new)) < 1e-5
    assert max_diff(got, gpu_logprobs(ref)) > 1e-3, "the push changed the engine's outputs"
    sender.close()
