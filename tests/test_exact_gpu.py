"""`engines.exact` on one CUDA GPU (`make test-gpu`): SmolLM2-135M's shape in bfloat16, the engine's
sampled log-probs equal the trainer's bit for bit.

The same comparison as `tests/test_exact.py` on the CPU: the real scheduler over the real `ModelRunner`,
and over the slot runner replaying CUDA graphs as the engine runs it on a GPU, with 1, 7 and 64 requests in
flight, later ones joining mid-decode; the trainer's `policy_logprobs` over
right-padded rows, packed rows and packed rows under document attention. The weights are random (built
from `configs/models/smollm2-135m`; no download), which changes nothing in what is compared. With `exact`
off the same comparison fails (plain GPU forwards differ by batch shape), or the test could not.
"""

import copy

import pytest
import torch

from molt_hpc.models.exact import make_exact
from tests.conftest import ROOT
from tests.test_exact import _generate, _runner, _trainer_sides, _trajectories

pytestmark = pytest.mark.gpu
GPU = torch.device("cuda", 0)


@pytest.fixture(scope="module")
def smol():
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(ROOT / "configs/models/smollm2-135m")
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).to(GPU).eval()


@pytest.mark.parametrize("n", [1, 7, 64])
def test_exact_engine_logprobs_equal_the_trainers_on_a_gpu(smol, n):
    engine, trainer = make_exact(copy.deepcopy(smol)), make_exact(copy.deepcopy(smol))
    temperature = 0.7 if n == 7 else 1.0
    rows = _generate(engine, n, temperature, seed=n, device=GPU)
    for name, (mine, theirs) in _trainer_sides(trainer, _trajectories(rows), temperature, GPU).items():
        assert mine.numel() == sum(len(r.tokens) for r in rows)
        assert torch.equal(mine, theirs), (name, float((mine - theirs).abs().max()))


@pytest.mark.parametrize("n", [1, 7, 64])
def test_the_engines_graphed_slot_runner_gives_the_trainers_logprobs(smol, n):
    """What the engine runs on a GPU (`engine.main.model_runner`): the slot runner replaying CUDA graphs of its
    exact decode steps and prefills (`engine.exact_slots`)."""
    engine, trainer = make_exact(copy.deepcopy(smol)), make_exact(copy.deepcopy(smol))
    temperature = 0.7 if n == 7 else 1.0
    runner = _runner(engine, GPU, slots=True)
    rows = _generate(engine, n, temperature, seed=n, device=GPU, runner=runner)
    assert runner.graphs.graphs and runner.prefiller.recorded, "the exact forwards were not captured as CUDA graphs"
    for name, (mine, theirs) in _trainer_sides(trainer, _trajectories(rows), temperature, GPU).items():
        assert mine.numel() == sum(len(r.tokens) for r in rows)
        assert torch.equal(mine, theirs), (name, float((mine - theirs).abs().max()))


def test_plain_gpu_forwards_are_not_equal(smol):
    rows = _generate(smol, 64, 1.0, seed=64, device=GPU)
    sides = _trainer_sides(copy.deepcopy(smol), _trajectories(rows), 1.0, GPU)
    assert not all(torch.equal(mine, theirs) for mine, theirs in sides.values())


def test_the_fused_attention_kernel_passes_its_check_so_the_runs_above_used_it():
    from molt_hpc.models.exact_cuda_attention import usable

    assert usable(64, 9, 3, torch.bfloat16, GPU), "the fused kernel failed its check: exact ran the block form"
