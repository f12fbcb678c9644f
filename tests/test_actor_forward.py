"""The trainer's forwards (policy and reference log-probs, critic values) on packed rows.

Packed samples must not see each other. transformers builds the block-causal mask from restarting
position ids only when no KV cache exists, and creates one by default (`config.use_cache`), so
every trainer forward passes `use_cache=False`. Each packed sample is compared with its own
forward alone, in eval mode (the frozen reference) and in train mode (the policy, the critic).
"""

import pytest
import torch

from molt_hpc.actor.batch import critic_values, policy_logprobs
from molt_hpc.actor.build import disable_dropout
from molt_hpc.algorithm import make_experience
from molt_hpc.trajectory import Trajectory


def _trajectories() -> list[Trajectory]:
    g = torch.Generator().manual_seed(0)
    out = []
    for prompt, action in [(5, 7), (3, 4), (6, 2)]:
        tokens = torch.randint(4, 90, (prompt + action,), generator=g).tolist()
        out.append(Trajectory(tokens, prompt, [(prompt, prompt + action)], [0.0] * action, [0] * action, 1.0))
    return out


def _per_sample(exp, values: torch.Tensor) -> dict[int, torch.Tensor]:
    return {n: values[exp.seq_index == n][exp.action_mask[exp.seq_index == n]] for n in range(exp.num_samples)}


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_packed_rows_match_each_sample_alone(tiny_model_dir, train):
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    policy = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).train(train)
    torch.manual_seed(0)
    critic = AutoModelForTokenClassification.from_pretrained(str(tiny_model_dir), num_labels=1).train(train)
    disable_dropout(critic)  # as the trainer builds it: its head has a dropout layer
    trajs = _trajectories()
    packed = make_experience(trajs, max_len=32, pack=True)
    assert packed.sequences.shape[0] == 1, "all samples share one row"
    forwards = {
        "logprobs": lambda exp: policy_logprobs(policy, exp, 1.0, 8)[0],
        "values": lambda exp: critic_values(critic, exp),
    }
    for name, fn in forwards.items():
        with torch.no_grad():
            together = _per_sample(packed, fn(packed))
            for n, t in enumerate(trajs):
                alone = make_experience([t], max_len=32)
                want = _per_sample(alone, fn(alone))[0]
                assert torch.allclose(together[n], want, atol=1e-5), (name, n, (together[n] - want).abs().max())
