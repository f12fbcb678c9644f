"""vLLM serving the tiny vision-language model on ONE GPU (`make test-gpu`): the colour task's prompts with
their images go through our front (render → `/inference/v1/generate` with features) and the trainer's
forward on the same GPU scores vLLM's samples (`bench/gpu_vlm.py`'s check).

The random tiny model's log-probs move by the image's own effect when another colour's image stands in a
prompt; vLLM's log-probs must sit well inside that (a quarter of it, in the mean over every action token),
which only holds when vLLM put each image's features at the trace's own tokens. Skipped without a GPU or
without vLLM.
"""

import importlib.util
import sys

import pytest

from tests.conftest import ROOT


def _gpus() -> int:
    import torch

    return torch.cuda.device_count()


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (pip install 'molt-hpc[gpu]')"),
    pytest.mark.skipif(_gpus() < 1, reason="needs a GPU"),
]


def test_vllm_serves_tiny_vl_with_the_trainers_log_probs(tmp_path) -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    import gpu_vlm

    got = gpu_vlm.check(tmp_path, None, dry=False)
    for name in ("bf16, packed rows", "bf16, padded rows", "fp32"):
        assert got[name] < 0.25 * got["effect"], (name, got)
