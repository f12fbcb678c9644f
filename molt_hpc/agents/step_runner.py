"""`StepEnvRunner`: one dataset row → one `Trajectory`, the framework owning the loop (env mode).

Token in, trace out. Per turn: generate (at most `rollout.max_new_tokens`, and never past
`rollout.max_total_tokens` for the whole trace) → decode the action with special tokens skipped →
`env.step` → append the action tokens with their engine log-probs and weight versions → stop when
the env terminates or truncates, the turns or the token budget run out; otherwise tokenise the
observation once, append it (it never trains) and go on. Nothing already in the trace is ever
tokenised again. With a vision-language model, images travel with the trace: the prompt's, then
each observation's (`Result.images`, their placeholders expanded as they are appended), and every
generate call sends them all beside the tokens. An action holding a vision token (an image pad the
model generated) ends the episode at once, flagged `media_token_in_action`: the trainer drops it.
The trajectory's reward is the sum of the step rewards; its score is the last step's explicit score,
else that reward.
"""

import asyncio
import hashlib
from collections.abc import Awaitable, Callable
from typing import Any

from molt_hpc.agents.base import Env, Result, State
from molt_hpc.agents.calls import EngineError, EnvError, call_user
from molt_hpc.agents.observation import ObservationFormatter
from molt_hpc.config.rollout import RolloutConfig
from molt_hpc.data import Prompt, render_prompt, render_prompt_images
from molt_hpc.trajectory import TraceImage, Trajectory
from molt_hpc.vision.images import image_bytes
from molt_hpc.vision.prompt import has_images, normalise

# (token_ids, sampling_params, session_id[, images=...]) -> an object shaped like
# molt_hpc.engine.client.GenerateResult; `images` is passed only when the trace has some.
GenerateFn = Callable[..., Awaitable[Any]]


def base_sampling_params(cfg: RolloutConfig, stop_token_ids: list[int]) -> dict[str, Any]:
    """The engine sampling params a turn starts from (vLLM field names)."""
    return {
        "temperature": cfg.temperature,
        "top_p": cfg.top_p,
        "top_k": cfg.top_k,
        "max_tokens": cfg.max_new_tokens,
        "stop_token_ids": list(stop_token_ids),
    }


def turn_seed(rollout_id: str, turn: int, base_seed: int) -> int:
    """A per-(sample, turn) sampling seed, so a rollout is reproducible and samples differ."""
    digest = hashlib.sha256(f"{base_seed}:{rollout_id}:{turn}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


class StepEnvRunner:
    """Runs `Env` episodes through a generate function (the router, via the engine client)."""

    def __init__(
        self,
        env_cls: type[Env],
        tokenizer: Any,
        cfg: RolloutConfig,
        generate: GenerateFn,
        *,
        apply_chat_template: bool = True,
        system_prompt: str | None = None,
        seed: int = 0,
        vision: Any = None,
    ):
        self.env_cls = env_cls
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.generate = generate
        self.apply_chat_template = apply_chat_template
        self.system_prompt = system_prompt
        self.seed = seed
        self.vision = vision
        """The model's `molt_hpc.vision.processor.Vision` (None: a text model; images are refused)."""
        self.observations = ObservationFormatter(tokenizer, apply_chat_template)
        self.base_params = base_sampling_params(cfg, [tokenizer.eos_token_id])

    async def run(
        self,
        prompt: Prompt,
        *,
        rollout_id: str,
        group_id: str = "",
        session_id: str | None = None,
        overrides: dict[str, Any] | None = None,
    ) -> Trajectory:
        """One episode of `prompt`; raises `EnvError` or `EngineError` when the sample fails."""
        session_id = session_id or rollout_id
        timeout = self.cfg.env_timeout_s
        env = await call_user(self.env_cls, timeout=timeout, what=f"{self.env_cls.__name__}()")
        state = State(prompt=prompt.prompt, label=prompt.label, row=dict(prompt.extra))
        first = await call_user(env.reset, state, timeout=timeout, what="Env.reset")
        trace = _Trace(list(prompt.token_ids), list(prompt.images))
        if first is not None:
            trace = _Trace(*self._render_first(first, prompt))
        params = {**self.base_params, **(overrides or {})}
        reward, score, info, finish = 0.0, None, {}, "stop"
        for turn in range(self.cfg.max_turns):
            budget = self.cfg.max_total_tokens - len(trace.tokens)
            if budget <= 0:
                info["budget_exhausted"] = 1.0
                break
            sp = {**params, "max_tokens": max(1, min(int(params["max_tokens"]), self.cfg.max_new_tokens, budget))}
            sp.setdefault("seed", turn_seed(rollout_id, turn, self.seed))
            images = {"images": list(trace.images)} if trace.images else {}
            out = await self.generate(trace.tokens, sp, session_id, **images)
            if out.finish_reason == "abort":
                raise EngineError("the engine aborted the request")
            trace.add_action(out)
            finish = out.finish_reason
            if self.vision is not None and not self.vision.spec.media_token_ids.isdisjoint(out.token_ids):
                info["media_token_in_action"] = 1.0  # its features do not exist: the trainer drops the sample
                break
            _update_state(state, self.tokenizer, out, turn, sp)
            result = await call_user(env.step, state, timeout=timeout, what="Env.step")
            if not isinstance(result, Result):
                raise EnvError("api", f"Env.step returned {type(result).__name__}, not a Result")
            reward += result.reward
            score = result.score if result.score is not None else score
            info.update(result.info)
            if result.terminated or result.truncated:
                info["truncated"] = float(result.truncated)
                break
            if turn + 1 == self.cfg.max_turns:
                info["out_of_turns"] = 1.0
                break
            if result.observation is None:
                raise EnvError("api", "Env.step continued the episode (terminated=False) without an observation")
            message, obs_ids, obs_images = await self._observation(result, out.token_ids[-1] if out.token_ids else None)
            if len(trace.tokens) + len(obs_ids) >= self.cfg.max_total_tokens or (
                len(trace.images) + len(obs_images) > self.cfg.max_images
            ):
                info["budget_exhausted"] = 1.0  # no room for the observation and a reply to it
                break
            trace.images += [im.moved(len(trace.tokens)) for im in obs_images]
            trace.tokens += obs_ids
            state.history.append(message)
            params = {**self.base_params, **(overrides or {}), **(result.sampling_params or {})}
        info["turns"] = float(len(trace.ranges))
        return Trajectory(
            tokens=trace.tokens,
            prompt_len=trace.prompt_len,
            action_ranges=trace.ranges,
            action_logprobs=trace.logprobs,
            versions=trace.versions,
            reward=reward,
            score=score if score is not None else reward,
            finish_reason=finish,
            info=info,
            group_id=group_id,
            rollout_id=rollout_id,
            images=trace.images,
        )

    def _render_first(self, first: Any, prompt: Prompt) -> tuple[list[int], list[TraceImage]]:
        """The first observation's tokens and images; its image parts take the row's images, in order."""
        if not isinstance(first, str | list):
            raise EnvError("api", f"Env.reset returned {type(first).__name__}; return text, chat messages or None")
        if self.vision is not None and (prompt.images or (isinstance(first, list) and has_images(first))):
            try:
                return render_prompt_images(
                    self.tokenizer, self.vision, first, [im.data for im in prompt.images],
                    system_prompt=self.system_prompt, tools=prompt.extra.get("tools"),
                )  # fmt: skip
            except ValueError as err:
                raise EnvError("api", f"Env.reset: {err}") from err
        ids = render_prompt(
            self.tokenizer,
            first,
            apply_chat_template=self.apply_chat_template,
            system_prompt=self.system_prompt,
            tools=prompt.extra.get("tools"),
        )
        return ids, []

    async def _observation(
        self, result: Result, last: int | None
    ) -> tuple[dict[str, Any], list[int], list[TraceImage]]:
        """(the observation as a chat message, its token ids, its images placed in those ids); images are
        decoded and measured in a thread, off the event loop."""
        message = _as_message(result.observation)
        if not result.images:
            return message, self.observations.token_ids(result.observation, last), []
        if self.vision is None:
            raise EnvError("api", "Env.step returned images but model.path is not a vision-language model")
        try:
            (message,), refs = normalise([message], list(result.images))
            datas = [image_bytes(ref) for ref in refs]
            ids, images = await asyncio.to_thread(self.vision.expand, self.observations.token_ids(message, last), datas)
        except ValueError as err:
            raise EnvError("api", f"Env.step's images: {err}") from err
        return message, ids, images


class _Trace:
    """The growing token list with the action spans, their log-probs and versions, and the images."""

    def __init__(self, prompt_tokens: list[int], images: list[TraceImage] | None = None):
        self.tokens = list(prompt_tokens)
        self.images = list(images or [])
        self.prompt_len = len(prompt_tokens)
        self.ranges: list[tuple[int, int]] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []

    def add_action(self, out: Any) -> None:
        ids = list(out.token_ids)
        if len(out.logprobs) != len(ids) or len(out.weight_versions) != len(ids):
            raise EngineError(f"engine returned {len(ids)} tokens but {len(out.logprobs)} log-probs")
        if ids:
            self.ranges.append((len(self.tokens), len(self.tokens) + len(ids)))
        self.tokens += ids
        self.logprobs += [float(x) for x in out.logprobs]
        self.versions += [int(v) for v in out.weight_versions]


def _update_state(state: State, tokenizer: Any, out: Any, turn: int, params: dict[str, Any]) -> None:
    state.action_ids = list(out.token_ids)
    state.action_text = tokenizer.decode(out.token_ids, skip_special_tokens=True)
    state.finish_reason = out.finish_reason
    state.turn = turn
    state.sampling_params = dict(params)
    state.history.append({"role": "assistant", "content": state.action_text})


def _as_message(observation: str | dict[str, Any]) -> dict[str, Any]:
    return {"role": "user", "content": observation} if isinstance(observation, str) else dict(observation)
