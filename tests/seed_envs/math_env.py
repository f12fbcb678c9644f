"""A single-turn math env written exactly as a Molt user writes one (mapping access on the state, a
tensor reward, `reset` returning a dict), run unchanged by molt-hpc's tests."""

import re

import torch

from molt_hpc.agents import Env, Result

ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)


class MathEnv(Env):
    async def reset(self, state):
        return {"observation": f"{state['prompt']} Answer as <answer>N</answer>."}

    async def step(self, state) -> Result:
        match = ANSWER.search(state["action_text"])
        correct = match is not None and match.group(1).strip() == str(state.get("label")).strip()
        return Result(reward=torch.tensor(1.0 if correct else 0.0), terminated=True)
