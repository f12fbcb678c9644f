"""The mismatch observatory against a batch worked out by hand with plain Python floats."""

import math
from pathlib import Path

import torch

from molt_hpc.algorithm.mismatch import finish, observe

# One packed row holding sample 0 (prompt 2 tokens, turn 1: 2 actions, feedback 1 token, turn 2: 1 action)
# and sample 1 (prompt 1, 3 actions), then a padded row: sample 2 (prompt 1, 2 actions, 1 pad).
MASK = [[0, 0, 1, 1, 0, 1, 0, 1, 1, 1], [0, 1, 1, 0, 0, 0, 0, 0, 0, 0]]
SEQ = [[0, 0, 0, 0, 0, 0, 1, 1, 1, 1], [2, 2, 2, -1, -1, -1, -1, -1, -1, -1]]
VER = [[-1, -1, 3, 3, -1, 2, -1, 3, 3, 2], [-1, 3, 3, -1, -1, -1, -1, -1, -1, -1]]
TRAINER = [[0, 0, -1.0, -2.0, 0, -0.5, 0, -0.2, -3.0, -1.5], [0, -0.7, -0.1, 0, 0, 0, 0, 0, 0, 0]]
ENGINE = [[0, 0, -1.1, -1.0, 0, -0.9, 0, -0.2, -2.0, -0.6], [0, -0.4, -0.1, 0, 0, 0, 0, 0, 0, 0]]


def test_observatory_matches_the_hand_computed_batch():
    t = lambda x, dt=torch.float64: torch.tensor(x, dtype=dt)  # noqa: E731
    parts = observe(t(TRAINER), t(ENGINE), t(MASK, torch.bool), t(VER, torch.long), 3, t(SEQ, torch.long), 2.0)
    # same-version tokens: (0,2) (0,3) [sample 0 turn 1], (0,7) (0,8) [sample 1], (1,1) (1,2) [sample 2];
    # (0,5) and (0,9) are version 2
    d = [-1.0 + 1.1, -2.0 + 1.0, -0.2 + 0.2, -3.0 + 2.0, -0.7 + 0.4, -0.1 + 0.1]
    n = len(d)
    overall, tokens = parts[0]
    assert tokens == n
    assert math.isclose(float(overall["mismatch_abs_mean"]), sum(abs(x) for x in d) / n, rel_tol=1e-12)
    assert math.isclose(float(overall["mismatch_abs_max"]), 1.0, rel_tol=1e-12)
    assert math.isclose(float(overall["mismatch_k3"]), sum(math.exp(x) - 1 - x for x in d) / n, rel_tol=1e-12)
    assert math.isclose(float(overall["mismatch_over_threshold"]), 2 / n)  # |d| = 1.0 twice > log 2
    got = finish({"mismatch_log_ppl_ratio": float(overall["mismatch_log_ppl_ratio"])})["mismatch_ppl_ratio"]
    ppl_trainer = math.exp(-sum([-1.0, -2.0, -0.2, -3.0, -0.7, -0.1]) / n)
    ppl_engine = math.exp(-sum([-1.1, -1.0, -0.2, -2.0, -0.4, -0.1]) / n)
    assert math.isclose(got, ppl_trainer / ppl_engine, rel_tol=1e-12)
    # every sample has fewer than 256 action tokens: one length bucket, the overall tokens
    named = {k: (float(v), w) for m, w in parts[1:] for k, v in m.items()}
    assert named["mismatch_abs_mean_len_lt_256"] == (float(overall["mismatch_abs_mean"]), n)
    # turns: sample 0's first span is turn 1, its second (version 2: not counted) turn 2; samples 1, 2 turn 1
    assert math.isclose(named["mismatch_abs_mean_turn_1"][0], sum(abs(x) for x in d) / n)
    assert named["mismatch_abs_mean_turn_1"][1] == n and "mismatch_abs_mean_turn_2" not in named


def test_turns_count_spans_within_each_packed_sample():
    from molt_hpc.algorithm.mismatch import turn_numbers

    got = turn_numbers(torch.tensor(MASK, dtype=torch.bool), torch.tensor(SEQ))
    assert got.tolist() == [[0, 0, 1, 1, 0, 2, 0, 1, 1, 1], [0, 1, 1, 0, 0, 0, 0, 0, 0, 0]]


def test_no_same_version_token_reports_nothing():
    z = torch.zeros(1, 4, dtype=torch.float64)
    mask = torch.tensor([[False, True, True, True]])
    assert observe(z, z, mask, torch.full((1, 4), 1), 2, torch.zeros(1, 4, dtype=torch.long), 2.0) == []


def _step_rank(rank: int, store: str, model_dir: str, groups, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from molt_hpc.actor import build
    from molt_hpc.actor.state import Trainable
    from molt_hpc.actor.step import Models, train_step
    from molt_hpc.actor.world import World
    from molt_hpc.config import load_config

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    world = World(0, 1, torch.device("cpu"), init_device_mesh("cpu", (1,)))
    sets = ["actor.device='cpu'", "actor.micro_batch_size=2", "actor.groups_per_step=2", "rollout.n_samples=4",
            "rollout.temperature=1.0", f"model.path='{model_dir}'"]  # fmt: skip
    cfg = load_config(None, sets)
    results = {}
    for version in (0, 7):  # 0: the version the samples carry; 7: none of them
        policy = build.load_model(Path(model_dir), cfg, world, "policy")
        opt = build.build_optimizer(policy, cfg.actor, cfg.actor.lr)
        models = Models(policy=Trainable("policy", policy, opt, build.build_scheduler(opt, cfg.actor, 2)))
        results[version] = train_step(groups, cfg, models, world, pad_id=0, version=version)
    torch.save(results, out)
    dist.destroy_process_group()


def test_a_train_step_reports_the_mismatch_of_same_version_tokens(tiny_model_dir, tmp_path):
    """The engine's log-probs are the model's own (HF generate, fp32), shifted by 0.25 on every other
    sample: the step's mean |trainer - engine| is the shift's share, its max the shift."""
    from tests.ranks import spawn_ranks
    from tests.test_actor_support import sample_groups

    groups = sample_groups(tiny_model_dir, 2, 4, seed=5)
    shifted = total = 0
    for g in groups:
        for i, s in enumerate(g.samples):
            total += len(s.action_logprobs)
            if i % 2:
                s.action_logprobs = [x - 0.25 for x in s.action_logprobs]
                shifted += len(s.action_logprobs)
    out = tmp_path / "out.pt"
    spawn_ranks(_step_rank, (str(tmp_path / "store"), str(tiny_model_dir), groups, str(out)), 1)
    got = torch.load(out)
    same = got[0]
    assert same["mismatch_tokens"] == total
    assert abs(same["mismatch_abs_mean"] - 0.25 * shifted / total) < 1e-5
    assert abs(same["mismatch_abs_max"] - 0.25) < 1e-5
    assert abs(same["mismatch_over_threshold"]) == 0.0  # |d| <= 0.25 < log 2
    assert abs(math.log(same["mismatch_ppl_ratio"]) - (-0.25 * shifted / total)) < 1e-5  # d = +0.25 shifted
    assert not any(k.startswith("mismatch") for k in got[7]), "no token of version 7: nothing reported"
