"""A multi-turn tool env written exactly as a Molt user writes one: an answer ends the episode with
its reward; a tool call gets the tool's output as the next observation and the episode goes on;
anything else ends the episode, scored. Rewards are tensors and numpy scalars, the state a mapping."""

import re

import numpy as np
import torch

from molt_hpc.agents import Env, Result

ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)
TOOL = re.compile(r"<tool>([0-9+*\- ]+)</tool>")


class ToolEnv(Env):
    async def reset(self, state):
        return {"observation": f"{state['prompt']} Call <tool>EXPR</tool> or answer <answer>N</answer>."}

    async def step(self, state) -> Result:
        text = state["action_text"]
        info = {"context_chars": float(len(state["observation_text"])),
                "max_tokens": float(state["sampling_params"]["max_tokens"])}  # fmt: skip
        if (answer := ANSWER.search(text)) is not None:
            correct = answer.group(1).strip() == str(state.get("label"))
            return Result(reward=torch.tensor(float(correct)), terminated=True, info=info)
        if (call := TOOL.search(text)) is not None:
            value = eval(call.group(1), {"__builtins__": {}})  # digits and + - * only (the pattern)
            return Result(reward=np.float32(0.0), observation=f"<result>{value}</result>", terminated=False, info=info)
        return Result(reward=np.float64(0.0), score=torch.tensor(-1.0), terminated=True, info=info)
