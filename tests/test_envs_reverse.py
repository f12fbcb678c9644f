"""The reverse task: a prompt-dependent reward, the shipped data, and its deterministic generator."""

import filecmp
import itertools
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

from molt_hpc.agents import State
from molt_hpc.agents.loader import load_agent
from molt_hpc.models import build_tiny_tokenizer

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data"
reverse = load_agent(str(ROOT / "envs" / "reverse.py"))
reverse_reward = sys.modules[reverse.__module__].reverse_reward


def rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (DATA / name).read_text().splitlines()]


def test_reward_is_position_credit_over_the_longer_string() -> None:
    assert reverse_reward("cba", "cba") == 1.0
    assert reverse_reward(" cba\n", "cba") == 1.0
    assert reverse_reward("cbx", "cba") == 2 / 3
    assert reverse_reward("cbaaa", "cba") == 3 / 5
    assert reverse_reward("c", "cba") == 1 / 3
    assert reverse_reward("abc", "cba") == 1 / 3  # the unreversed prompt only matches the middle
    assert reverse_reward("", "cba") == 0.0


def test_env_scores_the_decoded_action() -> None:
    env = reverse()
    result = env.step(State(prompt="Reverse: abc", label="cba", action_text="cba"))
    assert (result.reward, result.terminated, result.info["exact"]) == (1.0, True, 1.0)


def test_special_tokens_do_not_count() -> None:
    tok = build_tiny_tokenizer()
    ids = [tok.convert_tokens_to_ids("<|im_start|>")] * 3
    label = "<|im"  # a label that the special token's spelling would match
    assert reverse_reward(tok.decode(ids), label) > 0  # what decoding specials as text would allow
    assert reverse_reward(tok.decode(ids, skip_special_tokens=True), label) == 0.0


def test_a_policy_that_ignores_the_prompt_scores_at_most_0_3() -> None:
    train = rows("reverse_train.jsonl")
    alphabet = sorted({ch for r in train for ch in r["label"]})
    assert len(alphabet) >= 4
    # Any prompt-ignoring policy is a mixture of fixed strings, so the best fixed string bounds it.
    # Cutting a string to 4 letters never loses credit (labels have at most 4), so lengths 1-4 cover it.
    labels = Counter(r["label"] for r in train)
    best = max(
        sum(n * reverse_reward("".join(s), label) for label, n in labels.items()) / len(train)
        for length in range(1, 5)
        for s in itertools.product(alphabet, repeat=length)
    )
    assert best <= 0.3
    # ... while a policy that reads the prompt scores 1.0.
    assert all(reverse_reward(r["prompt"].split(": ")[1][::-1], r["label"]) == 1.0 for r in train)


def test_shipped_data_shape() -> None:
    train, evaluation = rows("reverse_train.jsonl"), rows("reverse_eval.jsonl")
    assert len(train) >= 512 and len(evaluation) >= 16
    assert {len(r["label"]) for r in train} == {2, 3, 4}
    assert not {r["label"] for r in train} & {r["label"] for r in evaluation}
    assert len({r["id"] for r in train + evaluation}) == len(train) + len(evaluation)
    per_position = Counter(r["label"][0] for r in train)
    assert max(per_position.values()) / len(train) < 0.3  # letters are close to uniform
    assert 200 <= len(rows("math_train.jsonl")) <= 1000


def test_generator_is_deterministic(tmp_path: Path) -> None:
    subprocess.run([sys.executable, str(DATA / "make_datasets.py"), str(tmp_path)], check=True, timeout=60)
    for name in (
        "reverse_train.jsonl",
        "reverse_eval.jsonl",
        "math_train.jsonl",
        "calculator_sft_train.jsonl",
        "calculator_sft_eval.jsonl",
    ):
        assert filecmp.cmp(tmp_path / name, DATA / name, shallow=False), name
