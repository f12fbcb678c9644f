"""A reward model in RL: the built-in scorer process (vLLM's classify route, token-checked), the
orchestrator's client (waits while no scorer answers, skips dead ones) and the reward combinations.

Real parts: a scorer process started by `jobs/engine.py --role scorer` on loopback, a reward model
built offline from the tiny model (a fresh score head), aiohttp. Expected scores come from plain
transformers (`AutoModelForSequenceClassification`'s own pooling, one unpadded sequence at a time).
"""

import asyncio
import json
import math
import shutil

import aiohttp
import pytest
import torch

from molt_hpc.algorithm.reward_model import combine_reward, combine_rewards, needs_score, sigmoid
from molt_hpc.config.stages import RewardModelConfig
from molt_hpc.models.reward import MEAN_KEY, STD_KEY, load_reward_model
from molt_hpc.net import free_port
from molt_hpc.rundir import RunDir
from molt_hpc.scorer.client import ScorerClient
from molt_hpc.scorer.registry import scorer_file
from molt_hpc.trajectory import Group, Trajectory
from tests.test_engine_procs import make_run, spawn, wait_registered

SEQS = [[2, 30, 31, 3, 4, 2, 40, 3], [2, 50, 3], [2, 30, 31, 3, 4, 2, 41, 42, 43, 44, 3]]
MEAN, STD = 0.25, 2.0


def build_reward_dir(out, base, seed: int = 7):
    """A reward-model directory: the tiny model's backbone with a new score head, and held-out statistics."""
    model = load_reward_model(base, seed=seed)
    setattr(model.config, MEAN_KEY, MEAN)
    setattr(model.config, STD_KEY, STD)
    model.save_pretrained(out)
    for f in base.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, out / f.name)
    return out


def hf_scores(path, seqs) -> list[float]:
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(path, local_files_only=True).eval()
    with torch.no_grad():
        return [float(model(input_ids=torch.tensor([s])).logits[0, 0]) for s in seqs]


@pytest.fixture(scope="module")
def scorer(tmp_path_factory, tiny_model_dir):
    rm = build_reward_dir(tmp_path_factory.mktemp("rm"), tiny_model_dir)
    run = make_run(tmp_path_factory.mktemp("scoring"), "scoring", tiny_model_dir,
                   f"reward_model.path={json.dumps(str(rm))}", "reward_model.max_model_len=128")  # fmt: skip
    p = wait_registered(run, spawn(run, "scorer"), "scorer-0")
    yield run, p, rm
    p.stop()


async def post(url: str, body, token: str | None):
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with aiohttp.ClientSession() as s, s.post(url + "/classify", json=body, headers=headers) as r:
        return r.status, await r.json()


def test_classify_scores_at_the_last_token(scorer) -> None:
    run, p, rm = scorer
    status, answer = asyncio.run(post(p.url, {"input": SEQS, "use_activation": False}, run.token()))
    assert status == 200, answer
    got = [d["probs"][0] for d in sorted(answer["data"], key=lambda d: d["index"])]
    want = hf_scores(rm, SEQS)  # batched and right-padded there, one unpadded sequence at a time here
    assert got == pytest.approx(want, abs=1e-5) and max(want) - min(want) > 1e-3
    status, answer = asyncio.run(post(p.url, {"input": SEQS[0], "use_activation": True}, run.token()))
    assert answer["data"][0]["probs"][0] == pytest.approx(sigmoid(want[0]), abs=1e-6)


def test_classify_refuses_without_the_token_and_bad_input(scorer) -> None:
    run, p, _ = scorer
    assert asyncio.run(post(p.url, {"input": SEQS}, None))[0] == 401
    assert asyncio.run(post(p.url, {"input": SEQS}, "wrong"))[0] == 401
    status, answer = asyncio.run(post(p.url, {"input": [[1, 2, 999]]}, run.token()))
    assert status == 400 and "outside the vocabulary" in answer["error"]
    status, answer = asyncio.run(post(p.url, {"input": [[5] * 129]}, run.token()))
    assert status == 400 and "over the scorer's 128" in answer["error"]
    assert asyncio.run(post(p.url, {"text": "hi"}, run.token()))[0] == 400


def test_client_waits_for_a_scorer_and_skips_dead_ones(scorer, tmp_path) -> None:
    """Only a dead scorer is registered: the request waits (trying again) until a live one registers."""
    run, _, rm = scorer
    elsewhere = RunDir(tmp_path)
    elsewhere.rendezvous.mkdir()
    dead = {"url": f"http://127.0.0.1:{free_port('127.0.0.1')}", "index": 0, "pid": 1, "kind": "builtin"}
    scorer_file(elsewhere, 0).write_text(json.dumps(dead))

    async def go():
        async with aiohttp.ClientSession() as session:
            client = ScorerClient(session, elsewhere, run.token(), RewardModelConfig(path=str(rm), timeout_s=5))
            task = asyncio.create_task(client.score(SEQS))
            while client.failures < 2:  # it tried the dead one, waited, tried it again
                assert not task.done()
                await asyncio.sleep(0.05)
            shutil.copy(scorer_file(run, 0), scorer_file(elsewhere, 1))
            return await asyncio.wait_for(task, 60), client

    scores, client = asyncio.run(go())
    assert scores == pytest.approx(hf_scores(rm, SEQS), abs=1e-5)
    assert client.failures >= 2


def test_group_scoring_gate_asks_only_valid_samples(scorer) -> None:
    from molt_hpc.rollout.scoring import GroupScorer

    run, _, rm = scorer
    env = [0.0, 0.5, 1.0, -0.2]
    samples = [Trajectory(s, 1, [(1, len(s))], [0.0] * (len(s) - 1), [0] * (len(s) - 1), reward=e)
               for s, e in zip([*SEQS, SEQS[0]], env, strict=True)]  # fmt: skip
    raw = hf_scores(rm, [SEQS[1], SEQS[2]])

    async def go(cfg):
        group = Group("g", "p", [Trajectory(**{**t.__dict__, "info": {}}) for t in samples])
        async with aiohttp.ClientSession() as session:
            client = ScorerClient(session, run, run.token(), cfg)
            await GroupScorer(client, cfg, (MEAN, STD)).score_group(group)
        return group, client.requests

    cfg = RewardModelConfig(path=str(rm), combine="gate", weight=2.0, gate_threshold=0.0)
    group, requests = asyncio.run(go(cfg))
    assert requests == 1 and [("rm_score" in s.info) for s in group.samples] == [False, True, True, False]
    z = [(s - MEAN) / STD for s in raw]
    want = [0.0, 0.5 + 2.0 / (1 + math.exp(-z[0])), 1.0 + 2.0 / (1 + math.exp(-z[1])), -0.2]
    assert [s.reward for s in group.samples] == pytest.approx(want, abs=1e-5)
    assert [s.info["env_reward"] for s in group.samples] == env and [s.score for s in group.samples] == env
    group, _ = asyncio.run(go(RewardModelConfig(path=str(rm), combine="replace")))
    assert group.samples[1].reward == pytest.approx(z[0], abs=1e-5)


def test_combine_formulas() -> None:
    assert combine_reward(0.3, 1.5, "replace") == 1.5
    assert combine_reward(0.3, 1.5, "add", weight=0.5) == pytest.approx(0.3 + 0.75)
    # gate: invalid samples keep the env's reward and are not asked; valid ones get env + w·sigmoid(z)
    assert not needs_score(0.0, "gate", 0.0) and needs_score(0.01, "gate", 0.0) and needs_score(-1.0, "add", 0.0)
    assert combine_reward(0.0, None, "gate") == 0.0
    assert combine_reward(1.0, 0.0, "gate", weight=2.0) == pytest.approx(2.0)
    env = [0.0, 0.0, 0.1, 0.1, 1.0]
    z = [None, None, -50.0, 50.0, -50.0]
    r = combine_rewards(env, z, "gate", weight=1.0, threshold=0.05)
    assert (
        r[:2] == [0.0, 0.0] and r[2] == pytest.approx(0.1) and r[3] == pytest.approx(1.1) and r[4] == pytest.approx(1.0)
    )
    # every valid sample outranks every invalid one with a lower or equal env reward, whatever z is
    assert min(r[2:]) > max(r[:2])
    assert sigmoid(-800.0) == 0.0 and sigmoid(800.0) == 1.0  # no overflow at either end


def test_rollout_records_score_every_finished_sample() -> None:
    """`env_reward_mean` and `rm_score_mean` average every finished sample the model scored, as `reward`
    does: a group dynamic sampling drops counts too; an unscored (gated) sample has no model score."""
    from molt_hpc.rollout.group import GroupOutcome
    from molt_hpc.rollout.metrics import RolloutStats

    def group(gid: str, parts: list[tuple[float, float | None]]) -> Group:
        samples = [Trajectory(SEQS[1], 1, [(1, 3)], [0.0, 0.0], [0, 0], reward=e + (z or 0.0),
                              info={"env_reward": e, **({"rm_score": z} if z is not None else {})})
                   for e, z in parts]  # fmt: skip
        return Group(gid, "p", samples)

    stats = RolloutStats()
    kept, dropped = group("a", [(1.0, 2.0), (0.0, None)]), group("b", [(0.5, -1.0), (0.5, -1.0)])
    for g in (kept, dropped):
        stats.finished(GroupOutcome(position=None, prompt=None, group=g))  # type: ignore[arg-type]
    stats.accepted(kept)
    stats.filtered("equal_rewards")
    rec = stats.record()
    assert rec["env_reward_mean"] == pytest.approx((1.0 + 0.0 + 0.5 + 0.5) / 4)
    assert rec["rm_score_mean"] == pytest.approx((2.0 - 1.0 - 1.0) / 3)
    assert rec["reward"] == pytest.approx((3.0 + 0.0 - 0.5 - 0.5) / 4) and rec["reward_trained"] == pytest.approx(1.5)
