"""Chat mode written the way users write it: the real `openai` client against the framework's endpoint.

Runs on the shared engine pool of the rollout tests (real engines and router); the chat agents are
real files loaded as `rollout.agent` would load them.
"""

import asyncio
import textwrap
from pathlib import Path

import pytest

from molt_hpc.agents.chat_runner import ChatAgentRunner
from molt_hpc.agents.grading import reverse_reward
from molt_hpc.agents.loader import load_agent
from molt_hpc.data import Position, PromptDataset
from molt_hpc.rollout.chat_server import ChatServer
from molt_hpc.rollout.group import run_group
from tests.rollout_support import check_logprobs, with_link
from tests.test_rollout_procs import ROOT

openai = pytest.importorskip("openai")  # the `chat` extra; `make test` installs it (dev extra)
pytestmark = pytest.mark.timeout(300)

TWO_TURNS = """
from openai import AsyncOpenAI, AuthenticationError
from molt_hpc.agents import ChatAgent, Result
class TwoTurns(ChatAgent):
    async def run(self, ctx):
        own = AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key)  # the seed's style: a client of its own
        first = [{"role": "user", "content": ctx.prompt}]
        one = await own.chat.completions.create(model=ctx.model, messages=first, max_tokens=6, seed=1)
        one = one.choices[0].message.content
        second = first + [{"role": "assistant", "content": one}, {"role": "user", "content": "again"}]
        two = await ctx.openai.chat.completions.create(model=ctx.model, messages=second, max_tokens=5, seed=2)
        await own.close()
        wrong = AsyncOpenAI(base_url=ctx.base_url, api_key="wrong", http_client=ctx.http_client, max_retries=0)
        try:
            await wrong.chat.completions.create(model=ctx.model, messages=first)
            refused = 0.0
        except AuthenticationError:  # the in-process path checks the token like the HTTP endpoint
            refused = 1.0
        await wrong.close()  # must not close the pool under the other episodes
        reward = float(len(two.choices[0].message.content))
        return Result(reward=reward, info={"replies": [one, second], "refused": refused})
"""


def run_agent(pool, tok, agent_file: Path, prompt_index: int):
    cfg = pool.cfg.rollout
    agent_cls = load_agent(str(agent_file))
    prompt = PromptDataset.load(pool.cfg.data, tok, limit=16)[prompt_index]

    async def go(link):
        server = ChatServer(tok, link, cfg, link.token)
        await server.start()
        runner = ChatAgentRunner(agent_cls, server, cfg, link.session)
        try:
            outcome = await run_group(runner, prompt, Position(0, prompt_index), cfg)
            wrong = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="not-the-token", max_retries=0)
            with pytest.raises(openai.AuthenticationError):
                await wrong.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}])
            await wrong.close()
            return outcome, dict(server.calls)
        finally:
            await runner.close()
            await server.close()

    outcome, leftover = with_link(pool, go)
    assert outcome.failure is None and not leftover  # every session's record was taken by its runner
    return prompt, outcome.group.samples


def test_the_shipped_chat_agent_scores_what_the_engine_generated(pool, tok, model) -> None:
    prompt, samples = run_agent(pool, tok, ROOT / "envs" / "reverse_chat.py", 3)
    text = tok.apply_chat_template(
        [{"role": "user", "content": prompt.prompt}], add_generation_prompt=True, tokenize=False
    )
    for s in samples:
        ((start, end),) = s.action_ranges
        assert s.tokens[:start] == tok(text, add_special_tokens=False)["input_ids"] and end == len(s.tokens)
        reply = tok.decode(s.tokens[start:end], skip_special_tokens=True)
        assert s.reward == reverse_reward(reply, prompt.label)
        assert s.info["exact"] == float(reply.strip() == prompt.label)
        check_logprobs(model, s)  # the engine's per-token log-probs, as env mode records them
        assert s.versions == [0] * s.num_action_tokens and s.info["chat_prefix_breaks"] == 0.0


def test_two_openai_calls_whose_prompts_extend_form_one_trajectory(pool, tok, tmp_path) -> None:
    path = tmp_path / "two_turns.py"
    path.write_text(textwrap.dedent(TWO_TURNS))
    _, samples = run_agent(pool, tok, path, 5)
    for s in samples:
        one, second = s.info.pop("replies")
        assert s.info["chat_calls"] == 2.0 and s.info["refused"] == 1.0  # the refused call was not recorded
        text = tok.apply_chat_template(second, add_generation_prompt=True, tokenize=False)
        start, end = s.action_ranges[-1]
        last = s.segments[-1] if s.segments else 0
        assert s.tokens[last:start] == tok(text, add_special_tokens=False)["input_ids"]
        assert s.reward == float(len(tok.decode(s.tokens[start:end], skip_special_tokens=True)))
        # Both replies are actions: of one sequence, or of two segments where the template re-tokenised the first.
        assert len(s.action_ranges) == 2 and len(s.segments) == int(s.info["chat_prefix_breaks"])
        a, b = s.action_ranges[0]
        assert tok.decode(s.tokens[a:b], skip_special_tokens=True) == one and a == s.prompt_len


def test_without_openai_ctx_openai_says_what_to_install(monkeypatch) -> None:
    from molt_hpc.agents import openai_client

    monkeypatch.setattr(openai_client.importlib.util, "find_spec", lambda name: None)
    pool = openai_client.OpenAIPool()
    client = pool.client("http://127.0.0.1:1/v1", "k")
    with pytest.raises(
        ValueError, match=r"ctx.openai needs the openai package; install it: pip install 'molt-hpc\[chat\]'"
    ):
        client.chat.completions.create(model="policy", messages=[])
    asyncio.run(pool.close())  # nothing was opened, nothing to close


RECORDED = """
from molt_hpc.agents import ChatAgent, Result
class Recorded(ChatAgent):
    async def run(self, ctx):
        messages, seen = [{"role": "user", "content": ctx.prompt}], []
        for turn in range(3):
            reply = await ctx.openai.chat.completions.create(
                model=ctx.model, messages=messages, logprobs=True, max_tokens=4 + turn, seed=turn
            )
            seen += [c.logprob for c in reply.choices[0].logprobs.content]
            messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                         {"role": "user", "content": "and again"}]
        return Result(reward=0.0, info={"seen": seen})
"""


def test_the_trace_trains_with_the_logprobs_the_engine_returned_to_the_agent(pool, tok, model, tmp_path) -> None:
    """`logprobs: true` hands the agent the engine's log-probs over HTTP; the recorded trace carries exactly
    those, call after call, and they are the model's own (teacher-forced, per segment)."""
    path = tmp_path / "recorded.py"
    path.write_text(RECORDED)
    _, samples = run_agent(pool, tok, path, 7)
    for s in samples:
        seen = s.info.pop("seen")
        assert len(s.action_ranges) == 3 and s.info["chat_calls"] == 3.0
        assert s.action_logprobs == seen  # exactly: the same numbers, through the buffer-bound record
        check_logprobs(model, s)
