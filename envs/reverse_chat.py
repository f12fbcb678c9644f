"""Reverse a short string in chat mode: the user's own loop, written with the real `openai` client.

The same task as `envs/reverse.py` (same data, same reward), as a `ChatAgent`: the agent owns the
conversation and talks to the framework's OpenAI-compatible endpoint, the way a third-party agent
or a black-box evaluation would. `ctx.openai` is an `openai.AsyncOpenAI` already bound to this
episode's session (every call reaches the same engine) and sharing one connection pool with the
other episodes; building your own works the same and is as cheap when it reuses that pool:
`AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, http_client=ctx.http_client)`.

Chat mode records the tokens of every call with the engine's per-token log-probs and rebuilds the
trajectory from them, so it trains like env mode (off-policy correction, async rollout). Needs
`pip install 'molt-hpc[chat]'`. Run it with
`molt-hpc run configs/tiny_cpu.toml --set rollout.agent=envs/reverse_chat.py`.
"""

from molt_hpc.agents import ChatAgent, Result
from molt_hpc.agents.grading import reverse_reward


class ReverseChatAgent(ChatAgent):
    """One call: send the prompt, score the reply's reversal."""

    async def run(self, ctx):
        reply = await ctx.openai.chat.completions.create(
            model=ctx.model, messages=[{"role": "user", "content": ctx.prompt}]
        )
        answer = reply.choices[0].message.content or ""
        label = str(ctx.label)
        return Result(reward=reverse_reward(answer, label), info={"exact": float(answer.strip() == label)})
