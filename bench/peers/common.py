"""What both sides of the peer benchmark share: the config, the rows, the model directory and the env's scorer.

Everything here comes from molt-hpc's own code, so TRL sees the same prompts (the same token ids), the same
labels, the same initial weights and the same reward: `load_agent` finds the config's env, `prompt_files` and
`PromptDataset` give the training and held-out rows (generated rows from the same generator and seeds),
`resolve_model` materialises the same HF directory a `builtin:` model becomes in a run, and `EnvScorer` calls
the env's `step` with a `State` built as molt-hpc's step runner builds it for a single-turn episode.
"""

import asyncio
import inspect
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from molt_hpc.agents import Env, Result, State  # noqa: E402
from molt_hpc.agents.step_runner import base_sampling_params  # noqa: E402
from molt_hpc.config import MoltConfig  # noqa: E402
from molt_hpc.config.load import load_config  # noqa: E402
from molt_hpc.data import Prompt, PromptDataset, as_messages  # noqa: E402

SYSTEMS = ("trl", "trl-vllm", "molt-builtin", "molt-vllm")
TINY_EVAL = (
    "eval.path=data/reverse_eval.jsonl",
    "eval.n=4",
    "eval.temperature=1.0",
    "eval.k=[1]",
    "eval.every=20",
    "eval.max_prompts=32",
)
"""The held-out evaluation given to a config without `[eval]` (the tiny reverse task's held-out file). A reverse
sample passes when its reward reaches `eval.pass_threshold` (1.0): only an exact reversal does."""


def bench_config(path: str, overrides: list[str]) -> tuple[MoltConfig, list[str]]:
    """The config both sides read, and the overrides that made it (with `TINY_EVAL` when it had no `[eval]`)."""
    cfg = load_config(path, overrides)
    if cfg.eval is None:
        overrides = [*overrides, *TINY_EVAL]
        cfg = load_config(path, overrides)
    return cfg, overrides


def single_turn_env(cfg: MoltConfig) -> type[Env]:
    """The config's env class; the benchmark gives TRL single-turn envs only (TRL's reward function sees one
    completion per prompt)."""
    from molt_hpc.agents import load_agent

    cls = load_agent(cfg.rollout.agent)
    if not issubclass(cls, Env):
        raise ValueError(f"rollout.agent = {cfg.rollout.agent!r} is a chat-mode agent: the bench compares env mode")
    if cfg.rollout.max_turns != 1 or cls.reset is not Env.reset:
        raise ValueError(
            f"rollout.agent = {cfg.rollout.agent!r}: the bench compares single-turn envs that keep the dataset's "
            "prompt (rollout.max_turns = 1, no Env.reset)"
        )
    return cls


class EnvScorer:
    """`Env.step` on one completion, as molt-hpc's step runner calls it for the first (and only) turn."""

    def __init__(self, cfg: MoltConfig, tokenizer: Any):
        self.env_cls = single_turn_env(cfg)
        self.tokenizer = tokenizer
        self.eos = tokenizer.eos_token_id
        self.params = base_sampling_params(cfg.rollout, [self.eos])

    def __call__(self, prompt: Prompt, completion_ids: list[int], overrides: dict | None = None) -> tuple[float, float]:
        """(reward, score) of `completion_ids` (the generated tokens, EOS included when it ended there);
        `overrides`: the sampling params that differ from the rollout's (an evaluation's)."""
        state = State(prompt=prompt.prompt, label=prompt.label, row=dict(prompt.extra))
        state.action_ids = list(completion_ids)
        state.action_text = self.tokenizer.decode(completion_ids, skip_special_tokens=True)
        state.finish_reason = "stop" if completion_ids and completion_ids[-1] == self.eos else "length"
        state.sampling_params = {**self.params, **(overrides or {})}
        state.history.append({"role": "assistant", "content": state.action_text})
        state.observation_text = self.tokenizer.decode(prompt.token_ids, skip_special_tokens=True)
        result = self.env_cls().step(state)
        if inspect.isawaitable(result):
            result = asyncio.run(result)
        assert isinstance(result, Result), f"Env.step returned {type(result).__name__}"
        return result.reward, result.score if result.score is not None else result.reward


def model_dir(cfg: MoltConfig, cache: Path) -> Path:
    """The HF directory of `model.path`; a `builtin:` model is built (or converted) into `cache` exactly as a
    run builds it into its own model cache (a deterministic function of the model config)."""
    from molt_hpc.models import resolve_model

    return resolve_model(cfg.model, cache)


def load_rows(cfg: MoltConfig, tokenizer: Any, work: Path) -> tuple[list[Prompt], list[Prompt]]:
    """(training rows, held-out rows) as a run loads them: generated rows are written into `work/data` from the
    same generator spec; held-out rows are the first `eval.max_prompts`."""
    from molt_hpc.datasets.generated import prompt_files

    train_path, eval_path = prompt_files(cfg, work)
    train = PromptDataset.load(cfg.data, tokenizer, path=train_path).prompts
    held = []
    if cfg.eval is not None and eval_path is not None:
        held = PromptDataset.load(cfg.data, tokenizer, path=eval_path, limit=cfg.eval.max_prompts).prompts
    if any(p.extra.get("tools") or p.images for p in [*train, *held]):
        raise ValueError("the bench gives TRL text prompts without tools or images")
    return train, held


def trl_prompt(prompt: Prompt, cfg: MoltConfig) -> str | list[dict[str, Any]]:
    """The prompt as TRL takes it: chat messages (TRL applies the chat template with the generation prompt and
    no special tokens, as `molt_hpc.data.render_prompt` does) or, without templating, the raw text (tokenised
    with special tokens by both)."""
    if cfg.data.apply_chat_template:
        return as_messages(prompt.prompt, cfg.data.system_prompt)
    assert isinstance(prompt.prompt, str)
    return prompt.prompt


def trl_reward(scorer: EnvScorer, rows: list[Prompt], counter: dict[str, int]):
    """TRL's reward function: the env's reward of each completion, from its token ids (decoded as molt-hpc
    decodes an action); counts the generated tokens into `counter["generated"]`."""

    def env_reward(prompts, completions, completion_ids, row_index, **kwargs) -> list[float]:
        counter["generated"] = counter.get("generated", 0) + sum(len(ids) for ids in completion_ids)
        return [scorer(rows[i], ids)[0] for i, ids in zip(row_index, completion_ids, strict=True)]

    env_reward.__name__ = "env_reward"
    return env_reward
