"""Envs written exactly as Molt users write them (`tests/seed_envs/`) run unchanged through the env-mode
runner: `async` reset and step, mapping access on the state, tensor and numpy rewards, `reset`
returning `{"observation": ...}`.

The policy here is a scripted stand-in (it replies with fixed texts, tokenised by the tiny model's
tokenizer) so that every branch of the tool env is taken on purpose; the runner, the tokenizer, the
observation glue and the trace are the real ones.
"""

import asyncio
from types import SimpleNamespace

import pytest

from molt_hpc.agents.loader import load_agent
from molt_hpc.agents.step_runner import StepEnvRunner
from molt_hpc.config import load_config
from molt_hpc.data import Prompt, render_prompt
from molt_hpc.models import build_tiny_tokenizer
from tests.conftest import ROOT

ENVS = ROOT / "tests" / "seed_envs"


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def scripted(tok, replies: list[str]):
    """A generate function that answers each turn with the next reply; it records the params it got."""
    seen: list[dict] = []

    async def generate(token_ids, params, session_id):
        seen.append(dict(params))
        ids = tok(replies[len(seen) - 1], add_special_tokens=False)["input_ids"]
        return SimpleNamespace(token_ids=ids, logprobs=[-0.5] * len(ids), weight_versions=[3] * len(ids),
                               finish_reason="stop")  # fmt: skip

    return generate, seen


def episode(tok, env_file: str, replies: list[str], label: str = "42"):
    cfg = load_config(None, ["rollout.max_turns=4", "rollout.max_new_tokens=48", "rollout.max_total_tokens=512"])
    env_cls = load_agent(str(ENVS / env_file))
    generate, seen = scripted(tok, replies)
    runner = StepEnvRunner(env_cls, tok, cfg.rollout, generate)
    text = "What is 6 times 7?"
    prompt = Prompt("p0", 0, text, label, render_prompt(tok, text))
    return asyncio.run(runner.run(prompt, rollout_id="r0", group_id="g0")), seen


def test_single_turn_math_env_in_molt_style(tok) -> None:
    right, _ = episode(tok, "math_env.py", ["<answer>42</answer>"])
    wrong, _ = episode(tok, "math_env.py", ["<answer>41</answer>"])
    assert type(right.reward) is float and (right.reward, wrong.reward) == (1.0, 0.0)
    assert right.score == 1.0 and len(right.action_ranges) == 1
    first = tok.decode(right.tokens[: right.prompt_len], skip_special_tokens=True)
    assert "What is 6 times 7? Answer as <answer>N</answer>." in first  # reset's {"observation": ...}


def test_multi_turn_tool_env_in_molt_style(tok) -> None:
    traj, seen = episode(tok, "tool_env.py", ["<tool>6*7</tool>", "<answer>42</answer>"])
    assert traj.reward == 1.0 and len(traj.action_ranges) == 2 and traj.info["turns"] == 2.0
    text = tok.decode(traj.tokens, skip_special_tokens=True)
    assert "<result>42</result>" in text  # the tool's output came back as the next observation
    # The second step saw the whole context before its action, and the params it was sampled with.
    (a0, b0), (a1, _) = traj.action_ranges
    assert traj.info["context_chars"] == len(tok.decode(traj.tokens[:a1], skip_special_tokens=True))
    assert traj.info["max_tokens"] == seen[1]["max_tokens"] and a0 < b0 < a1


def test_tool_env_stops_and_scores_anything_else(tok) -> None:
    traj, _ = episode(tok, "tool_env.py", ["no idea"])
    assert (traj.reward, traj.score, len(traj.action_ranges)) == (0.0, -1.0, 1)
    wrong, _ = episode(tok, "tool_env.py", ["<tool>6*6</tool>", "<answer>36</answer>"])
    assert wrong.reward == 0.0 and len(wrong.action_ranges) == 2
