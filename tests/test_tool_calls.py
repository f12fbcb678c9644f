"""Tool-call parsing as pure functions over reply text, the `tool_choice` prefixes, the request schema's
tool fields and the `rollout.tool_parser` config field."""

import json

import pytest

from molt_hpc.config import load_config
from molt_hpc.protocol.edge import BadRequest, parse
from molt_hpc.rollout.chat_schema import ChatRequest
from molt_hpc.rollout.chat_server import unsupported
from molt_hpc.rollout.tool_calls import forced_prefix, parse_hermes, parse_llama3, parse_reply

USER = [{"role": "user", "content": "2+3?"}]
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]


def calls(parsed):
    return [(c.name, json.loads(c.arguments)) for c in parsed[1]]


def test_hermes_calls_with_content_several_calls_and_an_unclosed_last_one() -> None:
    one = parse_hermes('<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>')
    assert one[0] is None and calls(one) == [("add", {"a": 2, "b": 3})]
    two = parse_hermes(
        'Let me add.\n<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>\n'
        '<tool_call>{"name": "mul", "arguments": "{\\"x\\": [1, 2]}"}'  # arguments as a JSON string, no closing tag
    )
    assert two[0] == "Let me add." and calls(two) == [("add", {"a": 1}), ("mul", {"x": [1, 2]})]
    assert json.loads(parse_hermes('<tool_call>{"name": "f", "arguments": {"s": "é"}}</tool_call>')[1][0].arguments)


@pytest.mark.parametrize(
    "text",
    [
        "just text, no call",
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>',  # arguments not an object
        '<tool_call>{"name": "add", "arguments": "{oops"}</tool_call>',
        '<tool_call>{"name": "add", "arguments": {}}</tool_call><tool_call>{"name": </tool_call>',  # one bad of two
        '<tool_call>["add"]</tool_call>',
    ],
)
def test_malformed_hermes_replies_are_plain_text(text) -> None:
    assert parse_hermes(text) is None


def test_llama3_json_calls() -> None:
    got = parse_llama3('{"name": "add", "parameters": {"a": 2, "b": 3}}')
    assert got[0] is None and calls(got) == [("add", {"a": 2, "b": 3})]
    two = parse_llama3('<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"x": 1}}')
    assert calls(two) == [("a", {}), ("b", {"x": 1})]


@pytest.mark.parametrize(
    "text",
    [
        "The answer is 5",
        '{"name": "add", "parameters": {"a": 2}} and then some text',
        '{"name": "add", "parameters": {"a": 2}',  # cut off
        '{"parameters": {}}',
        '{"name": "add", "parameters": 3}',
        '{"name": "a", "parameters": {}} {"name": "b", "parameters": {}}',  # no separator
    ],
)
def test_malformed_llama3_replies_are_plain_text(text) -> None:
    assert parse_llama3(text) is None


def test_parse_reply_honours_the_offer_and_the_choice() -> None:
    call = '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    assert calls(parse_reply("hermes", call, {"add"}, "auto"))[0][0] == "add"
    assert parse_reply("hermes", call, {"add"}, "none") is None  # tool_choice none: the reply stays text
    assert parse_reply("none", call, {"add"}, "auto") is None  # no parser: the agent reads the text
    assert parse_reply("hermes", call, {"mul"}, "auto") is None  # a function the request did not offer
    assert parse_reply("hermes", call, set(), None) is None  # no tools offered
    assert parse_reply("hermes", call, {"add", "mul"}, "function", "mul") is None  # not the forced one
    assert calls(parse_reply("hermes", call, {"add", "mul"}, "function", "add")) == [("add", {"a": 1})]
    llama = '{"name": "add", "parameters": {"a": 1}}'
    assert (
        parse_reply("llama3", llama, {"add"}, "required") is not None
        and parse_reply("hermes", llama, {"add"}, "auto") is None
    )


def test_forced_prefixes_open_the_formats_call() -> None:
    assert forced_prefix("hermes", "required") == '<tool_call>\n{"name": "'
    assert forced_prefix("hermes", "function", "add") == '<tool_call>\n{"name": "add", "arguments": '
    assert forced_prefix("llama3", "required") == '{"name": "'
    assert forced_prefix("llama3", "function", "add") == '{"name": "add", "parameters": '
    for choice in ("auto", "none", None):
        assert forced_prefix("hermes", choice) == ""
    # The prefix and the model's continuation parse as the forced call.
    text = forced_prefix("hermes", "function", "add") + '{"a": 2}}\n</tool_call>'
    assert calls(parse_reply("hermes", text, {"add"}, "function", "add")) == [("add", {"a": 2})]


def test_the_request_schema_checks_tools_and_normalises_messages() -> None:
    req = parse(
        ChatRequest,
        {"messages": USER, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "add"}}},
    )
    assert (req.choice, req.choice_name, req.offered) == ("function", "add", {"add"})
    assert parse(ChatRequest, {"messages": USER, "tools": TOOLS}).choice == "auto"
    assert parse(ChatRequest, {"messages": USER}).choice is None
    turn = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2}'}}]}  # fmt: skip
    tool = {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "5"}]}
    msgs = parse(ChatRequest, {"messages": [*USER, turn, tool]}).template_messages()
    assert msgs[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": {"a": 2}}}]}  # fmt: skip
    assert msgs[2] == {"role": "tool", "tool_call_id": "call_1", "content": "5"}
    bad = [
        ({"messages": USER, "tool_choice": "required"}, "tool_choice needs tools"),
        ({"messages": USER, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "mul"}}}, "'mul'"),
        ({"messages": USER, "tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"messages": USER, "tools": [{"type": "retrieval"}]}, "tools"),
        ({"messages": USER, "tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "text parts"),
        ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "x"}]}]}, "tool_calls need"),
    ]
    for body, needle in bad:
        with pytest.raises(BadRequest, match=needle):
            parse(ChatRequest, body)


@pytest.mark.parametrize("value", ["hermes", "llama3", "none"])
def test_the_tool_parser_is_a_config_field(value) -> None:
    assert load_config(None, [f"rollout.tool_parser={value!r}".replace("'", '"')]).rollout.tool_parser == value


def test_an_unknown_tool_parser_is_refused_with_exit_2(tmp_path) -> None:
    import subprocess

    from tests.conftest import BIN, ROOT

    out = subprocess.run([str(BIN / "molt-hpc"), "config", "--set", 'rollout.tool_parser="mistral"'],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 2, out.stdout + out.stderr
    assert "tool_parser" in out.stderr and "hermes" in out.stderr


def test_a_forced_tool_choice_needs_a_parser() -> None:
    for choice in ("required", {"type": "function", "function": {"name": "add"}}):
        req = parse(ChatRequest, {"messages": USER, "tools": TOOLS, "tool_choice": choice})
        param, why = unsupported(req, "none")
        assert param == "tool_choice" and "rollout.tool_parser" in why
        assert unsupported(req, "hermes") is None
    assert unsupported(parse(ChatRequest, {"messages": USER, "tools": TOOLS, "tool_choice": "none"}), "none") is None
