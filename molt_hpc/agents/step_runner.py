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

The env is reached through an env host (`molt_hpc.agents.env_hosts`): the orchestrator's threads by
default, or worker processes (`rollout.env_workers`) when the caller passes an `EnvWorkerPool`.
"""

import asyncio
import hashlib
from collections.abc import Awaitable, Callable
from typing import Any

from molt_hpc.agents.base import Env, Result, State
from molt_hpc.agents.calls import EngineError, EnvError
from molt_hpc.agents.env_hosts import EnvHost, Episode, InProcessEnvs
from molt_hpc.agents.observation import ObservationFormatter
from molt_hpc.agents.routing import RoutingTrace
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
        routed_experts: bool = False,
        envs: EnvHost | None = None,
        vision: Any = None,
    ):
        self.env_cls = env_cls
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.generate = generate
        self.apply_chat_template = apply_chat_template
        self.system_prompt = system_prompt
        self.seed = seed
        self.routed_experts = routed_experts
        """Keep the engine's MoE routing of every token (router replay; see `agents/routing.py`)."""
        self.envs = envs if envs is not None else InProcessEnvs(env_cls, cfg.env_timeout_s)
        """Where the env's construction, reset and step run."""
        self.default_reset = getattr(env_cls, "reset", None) is Env.reset
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
        """One episode of `prompt`; raises `EnvError`, `EngineError` or `EpisodeLost` when the sample fails."""
        state = State(prompt=prompt.prompt, label=prompt.label, row=dict(prompt.extra))
        episode = await self.envs.open(state)
        # An env that keeps `Env.reset` gets None from it: the first turn need not wait while the env is
        # built (in an env worker, a round trip).
        early = asyncio.ensure_future(episode.reset(state)) if self.default_reset else None
        try:
            ids = (rollout_id, group_id, session_id or rollout_id)
            return await self._play(episode, state, prompt, ids, overrides, early)
        finally:
            if early is not None and not early.done():
                early.cancel()
            if early is not None:
                early.add_done_callback(_retrieve)  # its error, if any, was raised by _play or is moot
            episode.close()

    async def _play(
        self,
        episode: Episode,
        state: State,
        prompt: Prompt,
        ids: tuple[str, str, str],
        overrides: dict[str, Any] | None,
        early: "asyncio.Future | None",
    ) -> Trajectory:
        rollout_id, group_id, _ = ids
        first = await episode.reset(state) if early is None else None
        first, reset_params = _unpack_reset(first)
        trace = _Trace(list(prompt.token_ids), list(prompt.images))
        if first is not None:
            trace = _Trace(*self._render_first(first, prompt))
        routing = RoutingTrace() if self.routed_experts else None
        params = {**self.base_params, **(overrides or {}), **reset_params}
        reward, score, info, finish = 0.0, None, {}, "stop"
        for turn in range(self.cfg.max_turns):
            budget = self.cfg.max_total_tokens - len(trace.tokens)
            if budget <= 0:
                info["budget_exhausted"] = 1.0
                break
            sp, out = await self._generate_turn(trace, params, budget, turn, ids, routing)
            context = len(trace.tokens)
            trace.add_action(out)
            finish = out.finish_reason
            if self.vision is not None and not self.vision.spec.media_token_ids.isdisjoint(out.token_ids):
                info["media_token_in_action"] = 1.0  # its features do not exist: the trainer drops the sample
                break
            _update_state(state, self.tokenizer, out, turn, sp)
            state.observation_text = self.tokenizer.decode(trace.tokens[:context], skip_special_tokens=True)
            if early is not None:  # the env must exist (and its construction have worked) before its first step
                await early
                early = None
            result = await episode.step(state)
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
            if not await self._append_observation(result, out, trace, state):
                info["budget_exhausted"] = 1.0  # no room for the observation and a reply to it
                break
            params = {**self.base_params, **(overrides or {}), **(result.sampling_params or {})}
        info["turns"] = float(len(trace.ranges))
        return Trajectory(
            tokens=trace.tokens, prompt_len=trace.prompt_len, action_ranges=trace.ranges,
            action_logprobs=trace.logprobs, versions=trace.versions, reward=reward,
            score=score if score is not None else reward, finish_reason=finish, info=info, group_id=group_id,
            rollout_id=rollout_id, routed_experts=None if routing is None else routing.rows(len(trace.tokens)),
            images=trace.images,
        )  # fmt: skip

    async def _generate_turn(
        self, trace: "_Trace", params: dict, budget: int, turn: int, ids: tuple[str, str, str], routing
    ) -> tuple[dict, Any]:
        """One turn's sampling params (capped by the length budget, seeded per turn) and the engine's output
        for the trace so far; an aborted request is an `EngineError`."""
        rollout_id, _, session_id = ids
        sp = {**params, "max_tokens": max(1, min(int(params["max_tokens"]), self.cfg.max_new_tokens, budget))}
        sp.setdefault("seed", turn_seed(rollout_id, turn, self.seed))
        asked = sp if routing is None else {**sp, "routed_experts_prompt_start": routing.have}
        images = {"images": list(trace.images)} if trace.images else {}
        try:
            out = await self.generate(trace.tokens, asked, session_id, **images)
        except EngineError as err:  # the sample starts again: its earlier turns' tokens go with it
            err.discarded += len(trace.logprobs)
            raise
        if out.finish_reason == "abort":
            raise EngineError("the engine aborted the request")
        if routing is not None:
            routing.add(getattr(out, "routed_experts", None), len(trace.tokens), len(out.token_ids))
        return sp, out

    async def _append_observation(self, result: Result, out: Any, trace: "_Trace", state: State) -> bool:
        """The env's next observation appended to the trace and the history (True), or False when the trace
        has no room left for it and a reply to it (tokens or images)."""
        if result.observation is None:
            raise EnvError("api", "Env.step continued the episode (terminated=False) without an observation")
        message, obs_ids, obs_images = await self._observation(result, out.token_ids[-1] if out.token_ids else None)
        if len(trace.tokens) + len(obs_ids) >= self.cfg.max_total_tokens or (
            len(trace.images) + len(obs_images) > self.cfg.max_images
        ):
            return False
        trace.images += [im.moved(len(trace.tokens)) for im in obs_images]
        trace.tokens += obs_ids
        state.history.append(message)
        return True

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


def _retrieve(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()


def _update_state(state: State, tokenizer: Any, out: Any, turn: int, params: dict[str, Any]) -> None:
    state.action_ids = list(out.token_ids)
    state.action_text = tokenizer.decode(out.token_ids, skip_special_tokens=True)
    state.finish_reason = out.finish_reason
    state.turn = turn
    state.sampling_params = dict(params)
    state.history.append({"role": "assistant", "content": state.action_text})


RESET_KEYS = ("observation", "sampling_params")


def _unpack_reset(first: Any) -> tuple[Any, dict[str, Any]]:
    """`Env.reset`'s answer as (first observation or None, sampling-param overrides): text, chat
    messages and None as they are; a dict (Molt's style) as `{"observation": ..., "sampling_params": ...}`."""
    if not isinstance(first, dict):
        return first, {}
    unknown = sorted(set(first) - set(RESET_KEYS))
    if unknown:
        raise EnvError("api", f"Env.reset returned a dict with {unknown}; its keys are {', '.join(RESET_KEYS)}")
    params = first.get("sampling_params") or {}
    if not isinstance(params, dict):
        raise EnvError("api", f"Env.reset's sampling_params is {type(params).__name__}, not a dict")
    return first.get("observation"), dict(params)


def _as_message(observation: str | dict[str, Any]) -> dict[str, Any]:
    return {"role": "user", "content": observation} if isinstance(observation, str) else dict(observation)
