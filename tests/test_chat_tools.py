"""OpenAI tool calling end to end: an agent loop written the usual way with the real `openai` client, against
the chat endpoint on a real engine process serving a model whose replies are known (`chat_tools_support`),
once per tool-call format (`rollout.tool_parser`)."""

import json

import pytest

from molt_hpc.agents.chat_runner import ChatAgentRunner
from molt_hpc.agents.loader import load_agent
from molt_hpc.data import Position, Prompt
from molt_hpc.models import load_causal_lm, load_tokenizer
from molt_hpc.rollout.chat_server import ChatServer
from molt_hpc.rollout.group import run_group
from molt_hpc.rollout.tool_calls import forced_prefix
from tests.chat_tools_support import FORMATS, build_tool_model
from tests.rollout_support import check_logprobs, with_link
from tests.test_rollout_procs import base_overrides, start_pool

openai = pytest.importorskip("openai")  # the `chat` extra; `make test` installs it (dev extra)
pytestmark = pytest.mark.timeout(300)

AGENT = """
import json
from molt_hpc.agents import ChatAgent, Result
TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
class AddAgent(ChatAgent):
    async def run(self, ctx):
        create, seen = ctx.openai.chat.completions.create, []
        messages = [{"role": "user", "content": ctx.prompt}]
        named = {"type": "function", "function": {"name": "add"}}
        reply = await create(model=ctx.model, messages=messages, tools=TOOLS, tool_choice=named)
        while reply.choices[0].message.tool_calls:
            seen.append(reply.choices[0].model_dump())
            messages.append(reply.choices[0].message)
            for call in reply.choices[0].message.tool_calls:
                args = json.loads(call.function.arguments)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": str(args["a"] + args["b"])})
            reply = await create(model=ctx.model, messages=messages, tools=TOOLS)
        seen.append(reply.choices[0].model_dump())
        forced = await create(model=ctx.model, messages=messages[:1], tools=TOOLS, tool_choice="required")
        seen.append(forced.choices[0].model_dump())
        return Result(reward=float(reply.choices[0].message.content == "5"), info={"seen": seen})
"""
TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]  # fmt: skip


@pytest.fixture(scope="module", params=["hermes", pytest.param("llama3", marks=pytest.mark.slow)])
def served(request, tmp_path_factory):
    fmt = request.param
    root = tmp_path_factory.mktemp(f"tools-{fmt}")
    model_dir = build_tool_model(root / "model", fmt)
    sets = [f'rollout.tool_parser="{fmt}"', "engines.max_model_len=2048", "rollout.max_total_tokens=2048"]
    pool = start_pool(root, base_overrides(model_dir) + sets, n_engines=1)
    yield fmt, pool, model_dir
    pool.stop()


def run_episodes(pool, tok, agent_file):
    cfg = pool.cfg.rollout
    agent_cls = load_agent(str(agent_file))
    prompt = Prompt(prompt_id="p0", row_index=0, prompt="What is 2 + 3?", label="5", token_ids=[1])

    async def go(link):
        server = ChatServer(tok, link, cfg, link.token)
        await server.start()
        runner = ChatAgentRunner(agent_cls, server, cfg, link.session)
        try:
            return await run_group(runner, prompt, Position(0, 0), cfg)
        finally:
            await runner.close()
            await server.close()

    outcome = with_link(pool, go)
    assert outcome.failure is None, outcome.failure
    return outcome.group.samples


def test_an_agent_loop_calls_the_tool_and_answers(served, tmp_path) -> None:
    fmt, pool, model_dir = served
    tok, model = load_tokenizer(model_dir), load_causal_lm(model_dir)
    path = tmp_path / "add_agent.py"
    path.write_text(AGENT)
    spec = FORMATS[fmt]
    for s in run_episodes(pool, tok, path):
        called, answered, forced = s.info.pop("seen")
        # The forced call came back parsed, as the OpenAI API shapes it.
        assert called["finish_reason"] == "tool_calls" and called["message"]["content"] is None
        (call,) = called["message"]["tool_calls"]
        assert call["type"] == "function" and call["id"].startswith("call_") and call["function"]["name"] == "add"
        assert json.loads(call["function"]["arguments"]) == {"a": 2, "b": 3}
        # The tool's result went back into the history; the model answered in text.
        assert answered["finish_reason"] == "stop" and answered["message"]["tool_calls"] is None
        assert answered["message"]["content"] == "5" and s.reward == 1.0
        # A malformed call (arguments that are not an object) is plain text, not an error.
        assert forced["finish_reason"] == "stop" and forced["message"]["tool_calls"] is None
        assert forced["message"]["content"] == forced_prefix(fmt, "required") + spec["bad"]
        check_trace(s, tok, model, fmt)


def check_trace(s, tok, model, fmt: str) -> None:
    """The trace: the tools rendered by the model's own template, the forced prefix as context, the call
    re-rendered into the very tokens the engine produced (one segment), the required call a second one."""
    user = [{"role": "user", "content": "What is 2 + 3?"}]
    rendered = tok.apply_chat_template(user, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert '{"type": "function", "function": {"name": "add"' in rendered  # the tools, as the template writes them
    decode = lambda a, b: tok.decode(s.tokens[a:b], skip_special_tokens=False)  # noqa: E731
    assert decode(0, s.prompt_len) == rendered + forced_prefix(fmt, "function", "add")
    (a1, b1), (a2, b2), (a3, b3) = s.action_ranges
    assert b3 == len(s.tokens) and decode(a3, b3) == FORMATS[fmt]["bad"] + "<|im_end|>"
    assert decode(a1, b1) == FORMATS[fmt]["args"] + "<|im_end|>"
    assert (
        decode(b1, a2) == "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n" and decode(a2, b2) == "5<|im_end|>"
    )
    assert s.segments == [b2] and s.info["chat_prefix_breaks"] == 1.0 and s.info["chat_calls"] == 3.0
    assert decode(b2, a3) == rendered + forced_prefix(fmt, "required")
    assert s.action_logprobs == [0.0] * s.num_action_tokens  # this model is sure of every token
    check_logprobs(model, s)


def test_a_streamed_reply_brings_its_tool_calls_at_the_end(served) -> None:
    """`stream: true` with tools: the reply is parsed once whole, then sent as chunks: the call in
    `delta.tool_calls`, finish reason `tool_calls`; a reply that makes no call streams its text."""
    fmt, pool, model_dir = served
    tok = load_tokenizer(model_dir)
    ask = [{"role": "user", "content": "What is 2 + 3?"}]

    async def go(link):
        server = ChatServer(tok, link, pool.cfg.rollout, link.token)
        await server.start()
        chat = openai.AsyncOpenAI(base_url=f"{server.url}/s/tools/v1", api_key=link.token, max_retries=0)
        try:
            named = {"type": "function", "function": {"name": "add"}}
            called = await chat.chat.completions.create(model="policy", messages=ask, tools=TOOLS, tool_choice=named,
                                                        stream=True)  # fmt: skip
            called = [c async for c in called]
            plain = await chat.chat.completions.create(model="policy", messages=ask, stream=True)
            return called, [c async for c in plain], server.calls.pop("tools")
        finally:
            await chat.close()
            await server.close()

    called, plain, calls = with_link(pool, go)
    deltas = [c.choices[0] for c in called]
    assert deltas[0].delta.role == "assistant" and deltas[-1].finish_reason == "tool_calls"
    assert "".join(d.delta.content or "" for d in deltas) == ""
    ((call,),) = [d.delta.tool_calls for d in deltas if d.delta.tool_calls]
    assert call.index == 0 and call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 2, "b": 3}
    assert calls[0].completion_ids == tok(FORMATS[fmt]["args"] + "<|im_end|>", add_special_tokens=False)["input_ids"]
    assert "".join(c.choices[0].delta.content or "" for c in plain) == "5"
    assert plain[-1].choices[0].finish_reason == "stop" and len(calls) == 2
