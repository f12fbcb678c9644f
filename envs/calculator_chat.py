"""Arithmetic with a calculator tool in chat mode: the OpenAI tool-calling loop, written as agents are.

The task of `envs/calculator.py` (the rows of `data/math_train.jsonl`, answers graded like
`envs/math.py`), as a `ChatAgent`: the calculator is offered as an OpenAI tool (`tools=[...]`), the
model's chat template writes it into the prompt, the chat endpoint parses the model's calls into
`message.tool_calls` (`rollout.tool_parser`), and the loop answers each with a `tool` message until
the model replies in text, at most `MAX_CALLS` calls. The tool evaluates with
`molt_hpc.agents.arith.calculate` (never `eval`); a bad expression or bad arguments answer
`error: ...`, which the model reads and goes on.

Every call's tokens and the engine's log-probs are recorded, so the episode trains like an env-mode
one (`docs/agents.md`). Needs `pip install 'molt-hpc[chat]'`; `configs/tiny_calculator_chat_cpu.toml`
runs it on the tiny model.
"""

import json

import openai

from molt_hpc.agents import ChatAgent, Result
from molt_hpc.agents.arith import CALCULATOR_TOOL, calculate
from molt_hpc.agents.grading import grade

MAX_CALLS = 3
TOOLS = [CALCULATOR_TOOL]


def run_tool(name: str, arguments: str) -> str:
    """The tool's answer to one call (an error is an answer too: the model reads it)."""
    if name != "calculate":
        return f"error: no tool named {name!r}; call calculate"
    try:
        expression = json.loads(arguments)["expression"]
    except (ValueError, KeyError, TypeError):
        return 'error: pass {"expression": "..."}'
    return calculate(str(expression))


class CalculatorChatAgent(ChatAgent):
    """Ask, answer every tool call, and grade the final text reply."""

    async def run(self, ctx):
        messages = ctx.prompt if isinstance(ctx.prompt, list) else [{"role": "user", "content": ctx.prompt}]
        messages, calls = list(messages), 0
        reply = await ctx.openai.chat.completions.create(model=ctx.model, messages=messages, tools=TOOLS)
        while reply.choices[0].message.tool_calls and calls < MAX_CALLS:
            messages.append(reply.choices[0].message)
            for call in reply.choices[0].message.tool_calls:
                calls += 1
                answer = run_tool(call.function.name, call.function.arguments)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": answer})
            try:
                reply = await ctx.openai.chat.completions.create(model=ctx.model, messages=messages, tools=TOOLS)
            except openai.BadRequestError as err:  # the conversation outgrew rollout.max_total_tokens
                if err.code != "context_length_exceeded":
                    raise
                break
        score, info = grade(reply.choices[0].message.content or "", ctx.label)
        return Result(reward=score, info={**info, "calls": float(calls)})
