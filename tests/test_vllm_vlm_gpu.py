"""vLLM serving the tiny vision-language model on ONE GPU (`make test-gpu`): the colour task's prompts with
their images go through our front (render → `/inference/v1/generate` with features) and the trainer's
forward on the same GPU scores vLLM's samples (`bench/gpu_vlm.py`'s check); then a short `molt-hpc run` of
the colour task trains on vLLM's rollouts, refit through CUDA IPC on the same GPU (its train part).

The random tiny model's log-probs move by the image's own effect when another colour's image stands in a
prompt; vLLM's log-probs must sit well inside that (a quarter of it, in the mean over every action token),
which only holds when vLLM put each image's features at the trace's own tokens. Skipped without a GPU or
without vLLM.
"""

import sys

from molt_hpc.log import read_metrics
from tests.conftest import ROOT, vllm_gpu_marks

pytestmark = vllm_gpu_marks()


def test_vllm_serves_tiny_vl_with_the_trainers_log_probs(tmp_path) -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    import gpu_vlm

    got = gpu_vlm.check(tmp_path, None, dry=False)
    for name in ("bf16, packed rows", "bf16, padded rows", "fp32"):
        assert got[name] < 0.25 * got["effect"], (name, got)


def test_a_short_run_trains_on_vllm_rollouts(tmp_path) -> None:
    """Every step trains and vLLM ends on the trainer's last weights. At step 1 both sides hold the initial
    weights, so `kl_rollout` (k3 of the engine's against the trainer's log-probs of the trained tokens) is
    their numeric gap alone, bf16 on both sides: ~Δ²/2, well under 1e-3 for a mean |Δ| of 1e-2. Later
    steps add the samples' staleness (up to `buffer.max_staleness` versions) and are reported only."""
    sys.path.insert(0, str(ROOT / "bench"))
    import gpu_vlm

    actor = gpu_vlm.train(tmp_path, None, dry=False)
    assert [r["step"] for r in actor] == list(range(1, gpu_vlm.TRAIN_STEPS + 1))
    assert actor[0]["kl_rollout"] < 1e-3, [r["kl_rollout"] for r in actor]
    assert read_metrics(tmp_path / "train" / "metrics.jsonl", source="launcher")[-1]["engine_versions"] == {
        "engine-0": gpu_vlm.TRAIN_STEPS
    }
