"""The calculator env and its safe evaluator: exact arithmetic, refusals, the multi-turn protocol."""

from fractions import Fraction
from pathlib import Path

import pytest

from molt_hpc.agents import State
from molt_hpc.agents.arith import ArithError, evaluate
from molt_hpc.agents.loader import load_agent

ROOT = Path(__file__).resolve().parents[1]
Calculator = load_agent(str(ROOT / "envs" / "calculator.py"))


@pytest.mark.parametrize(
    ("expr", "value"),
    [
        ("3*7", Fraction(21)),
        ("2^10", Fraction(1024)),
        ("2**-2", Fraction(1, 4)),
        ("0.1 + 0.2", Fraction(3, 10)),  # exact, unlike floats
        ("1/3 + 1/6", Fraction(1, 2)),
        ("-(4 - 10) % 4", Fraction(2)),
        ("7 // 2", Fraction(3)),
        ("(1 + 2) * (3 + 4)", Fraction(21)),
        ("1e3 − 1", Fraction(999)),
        ("6 × 7 ÷ 2", Fraction(21)),
    ],
)
def test_evaluates_exactly(expr: str, value: Fraction) -> None:
    assert evaluate(expr) == value


def test_fractional_powers_fall_back_to_float() -> None:
    assert evaluate("4 ** 0.5") == pytest.approx(2.0)


@pytest.mark.parametrize(
    ("expr", "why"),
    [
        ("__import__('os').system('true')", "unsupported element Call"),
        ("open('x')", "unsupported element Call"),
        ("x + 1", "unsupported element Name"),
        ("(1).__class__", "unsupported element Attribute"),
        ("[1, 2]", "unsupported element List"),
        ("lambda: 1", "unsupported element Lambda"),
        ("1 if 1 else 2", "unsupported element IfExp"),
        ("1 < 2", "unsupported element Compare"),
        ("True + 1", "unsupported element Constant"),
        ("'a' * 3", "unsupported element Constant"),
        ("1j", "unsupported element Constant"),
        ("9**9**9", "exponent"),
        ("2 ** 100000", "exponent"),
        ("*".join(["10**64"] * 20), "too large"),
        ("1" * 100, "literal too long"),
        ("1/0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("0 ** -1", "division by zero"),
        ("(-8) ** 0.5", "negative"),
        ("1 +", "not an arithmetic expression"),
        ("(" * 150 + "1" + ")" * 150, "longer than"),
        ("", "empty"),
        ("1" + "+1" * 150, "longer than"),
    ],
)
def test_refuses_anything_but_bounded_arithmetic(expr: str, why: str) -> None:
    with pytest.raises(ArithError, match=why):
        evaluate(expr)


def step(env, text: str, label: str = "21", turn: int = 0):
    return env.step(State(prompt="What is 3*7?", label=label, action_text=text, turn=turn))


def test_a_call_returns_its_result_then_an_answer_ends_the_episode() -> None:
    env = Calculator()
    first = step(env, "let me compute <calc>3*7</calc>")
    assert (first.observation, first.terminated, first.reward) == ("<result>21</result>", False, 0.0)
    second = step(env, "<answer>21</answer>", turn=1)
    assert (second.terminated, second.reward, second.info["calls"]) == (True, 1.0, 1.0)


def test_bad_expressions_answer_with_an_error_and_the_episode_goes_on() -> None:
    env = Calculator()
    result = step(env, "<calc>import os</calc>")
    assert result.observation.startswith("<result>error: ") and not result.terminated


def test_the_call_budget_ends_the_episode() -> None:
    env = Calculator()
    budget = __import__(Calculator.__module__).MAX_CALLS
    for turn in range(budget):
        assert not step(env, "<calc>1+1</calc>", turn=turn).terminated
    last = step(env, "<calc>1+1</calc>", turn=budget)
    assert last.truncated and last.reward == 0.0 and last.info["missing_answer"] == 1.0


def test_no_call_and_no_answer_ends_with_zero() -> None:
    result = step(Calculator(), "I think it is 21")
    assert (result.terminated, result.reward, result.info["missing_answer"]) == (True, 0.0, 1.0)


def test_the_chat_calculators_tool_answers_calls_and_errors() -> None:
    import sys

    agent = load_agent(str(ROOT / "envs" / "calculator_chat.py"))
    run_tool = sys.modules[agent.__module__].run_tool
    assert run_tool("calculate", '{"expression": "12 * (3 + 4)"}') == "84"
    assert run_tool("calculate", '{"expression": "1/3 + 1/6"}') == "1/2"
    assert run_tool("calculate", '{"expression": "__import__(\\"os\\")"}').startswith("error: ")
    assert run_tool("calculate", '{"expr": "1"}').startswith("error: pass")
    assert run_tool("calculate", "[1]").startswith("error: pass")
    assert run_tool("search", "{}") == "error: no tool named 'search'; call calculate"


def integer_value(expr: str) -> int:
    """The value of the demonstrations' forms (`a + b`, `a - b`, `a * b`, `a + b * c`), computed directly."""
    parts = expr.split()
    nums, ops = [int(p) for p in parts[::2]], parts[1::2]
    if ops == ["+", "*"]:
        return nums[0] + nums[1] * nums[2]
    (op,) = ops
    return {"+": nums[0] + nums[1], "-": nums[0] - nums[1], "*": nums[0] * nums[1]}[op]


def test_the_tool_calling_demonstrations_solve_the_task_in_both_modes() -> None:
    """data/calculator_sft_*.jsonl (configs/tiny_calculator_sft.toml): each env-form episode, replayed through
    the env, gets the demonstrated observation and reward 1; each chat-form reply, rendered by the tiny model's
    chat template and parsed as the chat endpoint parses it, calls the calculator with the prompt's expression,
    and the tool's answer is the demonstrated `tool` message. Values come from Python's own integer arithmetic."""
    import json
    import sys

    from molt_hpc.models.tiny_char import build_tiny_tokenizer
    from molt_hpc.rollout.tool_calls import parse_hermes

    agent = load_agent(str(ROOT / "envs" / "calculator_chat.py"))
    run_tool = sys.modules[agent.__module__].run_tool
    tok = build_tiny_tokenizer()

    def rows(name: str) -> list[dict]:
        return [json.loads(line) for line in (ROOT / "data" / name).read_text().splitlines()]

    seen = {}
    for kind in ("train", "eval"):
        for row in rows(f"calculator_sft_{kind}.jsonl"):
            ask, call, result, answer = row["messages"]
            expr = ask["content"].removeprefix("Compute ").split(". Write")[0]
            value = str(integer_value(expr))
            assert answer == {"role": "assistant", "content": f"<answer>{value}</answer>"}
            seen.setdefault(kind, set()).add(expr)
            if "tools" not in row:  # env form: the env's own protocol
                env = Calculator()
                first = step(env, call["content"], label=value)
                assert result == {"role": "user", "content": first.observation} and not first.terminated
                assert step(env, answer["content"], label=value, turn=1).reward == 1.0
                continue
            text = tok.apply_chat_template([ask, call], tools=row["tools"], tokenize=False)
            reply = text.rsplit("<|im_start|>assistant\n", 1)[1].removesuffix("<|im_end|>\n")
            _, (parsed,) = parse_hermes(reply)
            assert (parsed.name, json.loads(parsed.arguments)) == ("calculate", {"expression": expr})
            assert result["content"] == run_tool(parsed.name, parsed.arguments) == value
    assert len(seen["train"]) == 1024 and len(seen["eval"]) == 64 and not seen["train"] & seen["eval"]
    rl_prompts = {r["prompt"].removeprefix("Compute ").split(". Write")[0] for r in rows("math_train.jsonl")}
    assert not (seen["train"] | seen["eval"]) & rl_prompts, "the RL prompts are not demonstrated"
