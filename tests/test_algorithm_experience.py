"""Experience assembly: action masks, own-index log-probs, padding, packing, truncation, a real model."""

import numpy as np
import pytest
import torch

from molt_hpc.algorithm.experience import experience_from_groups, make_experience
from molt_hpc.algorithm.logprobs import token_logprobs
from molt_hpc.trajectory import Group, Trajectory


def multi_turn(reward: float = 1.0, group_id: str = "g0") -> Trajectory:
    """prompt (3) + action (2) + env feedback (2) + action (3): 10 tokens."""
    return Trajectory(
        tokens=[10, 11, 12, 20, 21, 30, 31, 22, 23, 24],
        prompt_len=3,
        action_ranges=[(3, 5), (7, 10)],
        action_logprobs=[-0.1, -0.2, -0.3, -0.4, -0.5],
        versions=[1, 1, 2, 2, 3],
        reward=reward,
        group_id=group_id,
    )


def single(n_prompt: int, n_action: int, reward: float = 0.0, group_id: str = "g", start: int = 40) -> Trajectory:
    tokens = list(range(start, start + n_prompt + n_action))
    return Trajectory(
        tokens=tokens,
        prompt_len=n_prompt,
        action_ranges=[(n_prompt, n_prompt + n_action)],
        action_logprobs=[-(i + 1) / 10 for i in range(n_action)],
        versions=[7] * n_action,
        reward=reward,
        group_id=group_id,
    )


def test_multi_turn_row_is_hand_checked():
    exp = make_experience([multi_turn(reward=0.5)], max_len=16, pad_id=0)
    assert exp.sequences.tolist() == [[10, 11, 12, 20, 21, 30, 31, 22, 23, 24]]
    assert exp.action_mask.tolist() == [[False] * 3 + [True] * 2 + [False] * 2 + [True] * 3]
    # own-index alignment: the engine's log-prob of token t sits at index t
    assert exp.action_log_probs[0].tolist() == pytest.approx([0, 0, 0, -0.1, -0.2, 0, 0, -0.3, -0.4, -0.5])
    assert exp.versions.tolist() == [[-1, -1, -1, 1, 1, -1, -1, 2, 2, 3]]
    assert exp.position_ids.tolist() == [list(range(10))]
    assert exp.reward.tolist() == [0.5]
    assert exp.stats["truncated_samples"] == 0 and exp.stats["dropped_action_tokens"] == 0


def test_right_padding_and_group_index():
    trajs = [single(2, 3, group_id="a"), single(4, 1, group_id="b"), single(1, 1, group_id="a")]
    exp = make_experience(trajs, max_len=32, pad_id=99)
    assert exp.sequences.shape == (3, 5)
    assert exp.sequences[2].tolist() == [40, 41, 99, 99, 99]
    assert exp.attention_mask[2].tolist() == [True, True, False, False, False]
    assert exp.seq_index[2].tolist() == [2, 2, -1, -1, -1]
    assert exp.position_ids[2].tolist() == [0, 1, 0, 1, 2]  # the padding block restarts at 0
    assert exp.group_index.tolist() == [0, 1, 0]
    assert exp.action_mask.sum(1).tolist() == [3, 1, 1]
    assert exp.num_action_tokens == 5


def test_packing_restarts_positions_and_keeps_samples_apart():
    trajs = [multi_turn(), single(2, 4), single(1, 3, start=60)]  # lengths 10, 6, 4
    exp = make_experience(trajs, max_len=10, pack=True)
    assert exp.sequences.shape == (2, 10)  # first-fit decreasing: [10], [6 + 4]
    assert exp.position_ids[1].tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2, 3]
    assert exp.seq_index[1].tolist() == [1] * 6 + [2] * 4
    assert exp.action_mask[1].tolist() == [False] * 2 + [True] * 4 + [False] + [True] * 3
    assert exp.action_log_probs[1, 7:].tolist() == pytest.approx([-0.1, -0.2, -0.3])
    assert exp.reward.shape == (3,)


@pytest.mark.parametrize(
    ("max_len", "kept_mask_len", "dropped"),
    [(16, 10, 0), (9, 7, 3), (8, 7, 3), (7, 7, 3), (5, 5, 3), (4, 3, 5)],
)
def test_truncation_drops_partial_actions(max_len, kept_mask_len, dropped):
    exp = make_experience([multi_turn()], max_len=max_len)
    full = [False] * 3 + [True] * 2 + [False] * 2 + [True] * 3
    if max_len == 4:  # the first action is cut inside: only the prompt remains
        full = [False] * 10
    elif max_len < 10:
        full = full[:7] + [False] * 3
    assert exp.sequences.shape[1] == kept_mask_len
    assert exp.action_mask[0].tolist() == full[:kept_mask_len]
    assert exp.stats["dropped_action_tokens"] == dropped
    assert exp.truncated.tolist() == [max_len < 10]
    assert exp.stats["empty_samples"] == (1 if max_len == 4 else 0)
    kept_logp = exp.action_log_probs[0][exp.action_mask[0]].tolist()
    assert kept_logp == pytest.approx([-0.1, -0.2, -0.3, -0.4, -0.5][: 5 - dropped])


def test_bad_inputs_get_clear_errors():
    bad = Trajectory(tokens=[1, 2], prompt_len=0, action_ranges=[(0, 2)], action_logprobs=[0.0, 0.0], versions=[0, 0])
    with pytest.raises(ValueError, match="prompt of at least one token"):
        make_experience([bad], max_len=8)
    with pytest.raises(ValueError, match="at least one trajectory"):
        make_experience([], max_len=8)
    with pytest.raises(ValueError, match="max_len"):
        make_experience([multi_turn()], max_len=1)


def test_from_groups_and_micro_batches():
    groups = [Group("x", "p0", [single(2, 2), single(2, 3)]), Group("y", "p1", [single(3, 1)])]
    exp = experience_from_groups(groups, max_len=16)
    assert exp.group_index.tolist() == [0, 0, 1]
    parts = exp.split(2)
    assert [p.sequences.shape[0] for p in parts] == [2, 1]
    assert parts[1].seq_index[0, 0].item() == 2 and parts[1].reward.shape == (3,)


def test_routed_experts_follow_tokens():
    t = single(2, 2)
    t.routed_experts = np.array([[[i, i + 1]] for i in range(4)], dtype=np.int16)  # 4 tokens, 1 layer, top-2
    u = single(1, 1)
    u.routed_experts = np.array([[[5, 6]], [[-1, -1]]], dtype=np.int16)
    exp = make_experience([t, u, single(2, 1)], max_len=9, pack=True)
    assert exp.routed_experts.shape == (1, 9, 1, 2) and exp.routed_experts.dtype == torch.int16
    flat = exp.routed_experts[0, :, 0].tolist()  # packed longest first: t (4), then the others (3, 2)
    assert flat[:4] == [[0, 1], [1, 2], [2, 3], [3, 4]]
    assert flat[4:7] == [[-1, -1]] * 3  # the sample without routing: live routing for its tokens
    assert flat[7:] == [[5, 6], [-1, -1]]  # u, whose last token the engine never forwarded
    assert exp.stats["unrouted_samples"] == 1
    assert make_experience([single(2, 2)], max_len=8).stats["unrouted_samples"] == 0
    w = single(1, 1)
    w.routed_experts = np.zeros((2, 2, 2), dtype=np.int16)
    with pytest.raises(ValueError, match=r"differ in \[layers, top_k\]"):
        make_experience([t, w], max_len=8)


def _sample_logprobs(model, exp) -> dict[int, list[float]]:
    """Per sample: the model's log-prob of its action tokens, from one forward over the batch."""
    with torch.no_grad():
        hidden = model.model(input_ids=exp.sequences, position_ids=exp.position_ids, use_cache=False).last_hidden_state
        logp, _ = token_logprobs(hidden, exp.sequences, lm_head_weight=model.lm_head.weight, mask=exp.action_mask)
    out: dict[int, list[float]] = {}
    for b, t in exp.action_mask.nonzero().tolist():
        out.setdefault(exp.seq_index[b, t].item(), []).append(logp[b, t].item())
    return out


def test_packed_padded_and_alone_give_the_same_logprobs(tiny_model_dir):
    from molt_hpc.models import load_causal_lm

    model = load_causal_lm(tiny_model_dir)
    g = torch.Generator().manual_seed(0)

    def rand(n_prompt, n_action):
        t = single(n_prompt, n_action)
        t.tokens = torch.randint(4, 104, (len(t.tokens),), generator=g).tolist()
        return t

    trajs = [rand(5, 7), rand(3, 4), rand(6, 2), rand(2, 9)]
    padded = _sample_logprobs(model, make_experience(trajs, max_len=16))
    packed = _sample_logprobs(model, make_experience(trajs, max_len=16, pack=True))
    for i, t in enumerate(trajs):
        alone = _sample_logprobs(model, make_experience([t], max_len=16))[0]
        # ground truth: the model's own logits, log_softmax, read at index t-1 for token t
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([t.tokens])).logits[0]
        ref = torch.log_softmax(logits.float(), -1)[torch.arange(t.prompt_len - 1, len(t.tokens) - 1)]
        ref = ref.gather(1, torch.tensor(t.tokens[t.prompt_len :])[:, None]).squeeze(1)
        assert alone == pytest.approx(ref.tolist(), abs=1e-5)
        assert padded[i] == pytest.approx(alone, abs=1e-5)
        assert packed[i] == pytest.approx(alone, abs=1e-5)
