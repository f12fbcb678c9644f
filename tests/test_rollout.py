"""Env-mode rollouts through real engine + router processes: traces, masks, log-probs, faults.

One engine pool (2 engines + the router) serves the whole module; the runners and groups run in
this process against it, exactly as the orchestrator drives them.
"""

import pytest

from molt_hpc.agents.chat_runner import ChatAgentRunner, ChatClient
from molt_hpc.agents.loader import load_agent
from molt_hpc.agents.observation import ObservationFormatter
from molt_hpc.agents.step_runner import StepEnvRunner
from molt_hpc.config.evaluation import EvalConfig
from molt_hpc.data import Position, Prompt, render_prompt
from molt_hpc.rollout.chat_server import ChatServer
from molt_hpc.rollout.evaluation import evaluate
from molt_hpc.rollout.group import run_group
from tests.rollout_support import NO_STOP, check_logprobs, env_file, with_link
from tests.test_rollout_procs import ROOT

pytestmark = pytest.mark.timeout(300)


def test_single_turn_group_is_exact(pool, tok, model, dataset) -> None:
    cfg = pool.cfg.rollout
    env_cls = load_agent(str(ROOT / "envs" / "reverse.py"))
    reward_fn = __import__(env_cls.__module__).reverse_reward
    prompt = dataset[3]

    async def go(link):
        runner = StepEnvRunner(env_cls, tok, cfg, link.generate)
        return await run_group(runner, prompt, Position(0, 3), cfg)

    outcome = with_link(pool, go)
    group = outcome.group
    assert outcome.failure is None and group.group_id == "e0-i3" and group.prompt_id == prompt.prompt_id
    assert len(group.samples) == cfg.n_samples
    assert len({s.rollout_id for s in group.samples}) == cfg.n_samples
    for s in group.samples:
        assert s.group_id == "e0-i3"
        assert s.tokens[: s.prompt_len] == prompt.token_ids  # the prompt is never re-tokenised
        assert s.action_ranges == [(s.prompt_len, len(s.tokens))]
        assert 1 <= s.num_action_tokens <= cfg.max_new_tokens
        assert s.versions == [0] * s.num_action_tokens
        action = s.tokens[s.prompt_len :]
        assert s.reward == reward_fn(tok.decode(action, skip_special_tokens=True), prompt.label)
        check_logprobs(model, s)


MULTI_TURN_ENV = """
class ThreeTurns(Env):
    def reset(self, state):
        return [{"role": "user", "content": "Reverse, then talk: " + state.label[::-1]}]

    def step(self, state):
        ok = state.action_text == TOKENIZER_DECODE(state.action_ids)
        if state.turn < 2:
            return Result(reward=0.25, observation=f"turn {state.turn}", terminated=False,
                          sampling_params={"max_tokens": 2 + state.turn}, info={"decoded": float(ok)})
        return Result(reward=1.0, terminated=True, info={"history": float(len(state.history))})
"""


def test_multi_turn_trace_masks_feedback_and_keeps_exact_logprobs(pool, tok, model, dataset, tmp_path) -> None:
    cfg = pool.cfg.rollout.model_copy(update={"max_turns": 3, "max_total_tokens": 256})
    env_cls = load_agent(env_file(tmp_path, MULTI_TURN_ENV))
    __import__(env_cls.__module__).TOKENIZER_DECODE = lambda ids: tok.decode(ids, skip_special_tokens=True)
    fmt = ObservationFormatter(tok)
    prompt = dataset[0]

    async def go(link):
        runner = StepEnvRunner(env_cls, tok, cfg, link.generate)
        return await run_group(runner, prompt, Position(0, 0), cfg)

    first = render_prompt(tok, [{"role": "user", "content": "Reverse, then talk: " + prompt.label[::-1]}])
    for s in with_link(pool, go).group.samples:
        assert s.tokens[: s.prompt_len] == first  # Env.reset replaced the dataset's prompt
        assert len(s.action_ranges) == 3 and s.reward == 1.5 and s.info["turns"] == 3.0
        assert s.info["decoded"] == 1.0 and s.info["history"] == 5.0  # 3 actions + 2 observations
        (a0, b0), (a1, b1), (a2, b2) = s.action_ranges
        assert a0 == s.prompt_len and b2 == len(s.tokens)
        assert b1 - a1 <= 2 and b2 - a2 <= 3  # the per-turn sampling-param overrides applied
        # Feedback between actions is exactly the observation, tokenised once after that action.
        assert s.tokens[b0:a1] == fmt.token_ids("turn 0", s.tokens[b0 - 1])
        assert s.tokens[b1:a2] == fmt.token_ids("turn 1", s.tokens[b1 - 1])
        mask = [any(a <= t < b for a, b in s.action_ranges) for t in range(len(s.tokens))]
        assert sum(mask) == s.num_action_tokens == len(s.versions)
        check_logprobs(model, s)


def test_token_budget_caps_every_turn(pool, tok, model, tmp_path) -> None:
    body = "class Go(Env):\n    def step(self, s):\n        return Result(0.0, observation='ok', terminated=False)\n"
    env_cls = load_agent(env_file(tmp_path, body))
    ids = render_prompt(tok, "Reverse: ab", apply_chat_template=False)
    prompt = Prompt("p", 0, "Reverse: ab", "ba", ids)
    cfg = pool.cfg.rollout.model_copy(update={"max_turns": 5, "max_total_tokens": len(ids) + 8 + 2 + 3})

    async def go(link):
        runner = StepEnvRunner(env_cls, tok, cfg, link.generate, apply_chat_template=False)
        return await runner.run(prompt, rollout_id="budget", overrides=NO_STOP)

    traj = with_link(pool, go)
    # 8 tokens (max_new_tokens), "ok" (2 tokens), then only the 3 tokens left of the budget.
    assert [b - a for a, b in traj.action_ranges] == [8, 3]
    assert len(traj.tokens) == cfg.max_total_tokens and traj.info["budget_exhausted"] == 1.0
    assert tok.decode(traj.tokens[traj.action_ranges[0][1] : traj.action_ranges[1][0]]) == "ok"
    check_logprobs(model, traj)


def test_greedy_evaluation_is_deterministic(pool, tok, dataset) -> None:
    env_cls = load_agent(str(ROOT / "envs" / "reverse.py"))

    async def go(link):
        runner = StepEnvRunner(env_cls, tok, pool.cfg.rollout, link.generate)
        greedy = EvalConfig(path="unused.jsonl")  # n = 1, temperature 0
        return [await evaluate(runner, dataset.prompts[:6], version=0, ev=greedy) for _ in range(2)]

    first, second = with_link(pool, go)
    assert first == second and first["eval_prompts"] == 6 and first["eval_errors"] == 0
    assert 0.0 <= first["eval_reward"] <= 1.0


CHAT_AGENT = """
from molt_hpc.agents import ChatAgent, Result
class TwoCalls(ChatAgent):
    async def run(self, ctx):
        first = [{"role": "user", "content": ctx.prompt}]
        one = await ctx.client.chat(first, max_tokens=6, seed=1)
        second = first + [{"role": "assistant", "content": one}, {"role": "user", "content": "again"}]
        two = await ctx.client.chat(second, max_tokens=5, seed=2)
        return Result(reward=float(len(two)), info={"replies": [one, two]})
"""


def test_chat_mode_through_the_framework_endpoint(pool, tok, model, dataset, tmp_path) -> None:
    path = tmp_path / "chat_agent.py"
    path.write_text(CHAT_AGENT)
    agent_cls = load_agent(str(path))
    cfg = pool.cfg.rollout
    prompt = dataset[5]

    async def go(link):
        server = ChatServer(tok, link, cfg, link.token)
        await server.start()
        try:
            runner = ChatAgentRunner(agent_cls, server, cfg, link.session)
            outcome = await run_group(runner, prompt, Position(0, 5), cfg)
            async with link.session.post(f"{server.url}/v1/chat/completions", json={"messages": []}) as resp:
                unauthorised = resp.status
            bad = ChatClient(link.session, f"{server.url}/v1", link.token)
            with pytest.raises(RuntimeError, match="HTTP 400"):
                await bad.chat([{"role": "user", "content": "x"}], stop=["x"])
            return outcome, unauthorised, server.calls
        finally:
            await server.close()

    outcome, unauthorised, leftover = with_link(pool, go)
    assert unauthorised == 401 and not leftover  # every session's record was taken by its runner
    assert outcome.failure is None
    for s in outcome.group.samples:
        one, two = s.info.pop("replies")
        assert s.reward == float(len(two)) and s.info["chat_calls"] == 2.0
        check_logprobs(model, s)  # the engine's own log-probs, segment by segment
        assert s.versions == [0] * s.num_action_tokens
        # The trace ends with the second call's prompt, templated from the conversation, and its reply.
        second = [{"role": "user", "content": prompt.prompt}, {"role": "assistant", "content": one},
                  {"role": "user", "content": "again"}]  # fmt: skip
        text = tok.apply_chat_template(second, add_generation_prompt=True, tokenize=False)
        start, end = s.action_ranges[-1]
        last = s.segments[-1] if s.segments else 0
        assert s.tokens[last:start] == tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(s.tokens[start:end], skip_special_tokens=True) == two and end == len(s.tokens)
        # Both replies are actions: one sequence, or two segments where the template re-tokenised the first.
        assert len(s.action_ranges) == 2 and len(s.segments) == int(s.info["chat_prefix_breaks"])
        a, b = s.action_ranges[0]
        assert tok.decode(s.tokens[a:b], skip_special_tokens=True) == one and a == s.prompt_len


FLAKY_ENV = """
import threading
CALLS = []
HANGING = threading.Event()
RELEASE = threading.Event()
class Flaky(Env):
    def step(self, state):
        CALLS.append(1)
        if MODE == "raise" and len(CALLS) == 1:
            raise RuntimeError("boom")
        if MODE == "hang" and len(CALLS) == 1:  # one sample hangs; the other must not time out too
            HANGING.set()
            RELEASE.wait(120)
            HANGING.clear()
        return Result(1.0)
"""


@pytest.mark.parametrize(
    ("mode", "policy", "failure", "env_errors", "env_retries"),
    [
        ("raise", "retry", None, {"raised": 1}, 1),
        ("raise", "drop_group", "env_raised", {"raised": 1}, 0),
        ("hang", "drop_group", "env_timeout", {"timeout": 1}, 0),
    ],
)
def test_env_failures_fail_only_their_sample(pool, tok, dataset, tmp_path, mode, policy, failure, env_errors,
                                             env_retries) -> None:  # fmt: skip
    env_cls = load_agent(env_file(tmp_path, FLAKY_ENV))
    module = __import__(env_cls.__module__)
    module.MODE = mode
    cfg = pool.cfg.rollout.model_copy(update={"on_env_error": policy, "env_timeout_s": 0.5, "n_samples": 2})

    async def go(link):
        runner = StepEnvRunner(env_cls, tok, cfg, link.generate)
        out = await run_group(runner, dataset[1], Position(0, 1), cfg)
        return out, module.HANGING.is_set()

    try:
        outcome, still_hanging = with_link(pool, go)
    finally:
        module.RELEASE.set()
    assert outcome.failure == failure
    assert dict(outcome.env_errors) == env_errors and outcome.env_retries == env_retries
    assert (outcome.group is None) == (failure is not None)
    # A hung env costs its timeout, not its hang: the group came back while the step still hung.
    assert still_hanging == (mode == "hang")
