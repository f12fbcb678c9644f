"""The OpenAI-compatible chat endpoint that chat-mode agents talk to, served on top of the engines.

`POST /v1/chat/completions` (and `/s/<session>/v1/chat/completions`, so any OpenAI client keeps
an episode on one engine without custom headers; `X-Session-ID` works too): the messages (and the
`tools`) go through the tokenizer's chat template, the router generates with the session id, the
reply is decoded with special tokens skipped and, when the request offered tools, read for tool calls
by `rollout.tool_parser` (`molt_hpc.rollout.tool_calls`). Every call is recorded per session as a
`ChatCall` (prompt ids, completion ids, the engine's per-token log-probs and weight versions, MoE
routing under router replay) for `ChatAgentRunner` to turn into a trajectory
(`molt_hpc.agents.chat_trace`). `logprobs: true` returns those same log-probs to the agent, and
`top_logprobs` (up to 20) each step's most likely tokens as the engine reports them. `n` choices are
generated together on the session's engine, each recorded as its own call (the trace gives each its own
segment; the conversation goes on from whichever the agent sends back). `stream: true` answers in
`chat.completion.chunk` events (`chat_stream.py`). Requests need the run's token as the API key.
Per-session overrides (greedy evaluation) apply to every call.
"""

import asyncio
import hmac
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from molt_hpc.agents.calls import EngineError
from molt_hpc.agents.chat_trace import ChatCall, routing_start
from molt_hpc.config.rollout import RolloutConfig
from molt_hpc.engine.client import SESSION_HEADER, EngineHTTPError
from molt_hpc.protocol.edge import (
    BadRequest,
    check_session,
    loads,
    openai_errors_middleware,
    openai_problem,
    parse,
    read_body,
    send,
)
from molt_hpc.rollout.chat_answer import Turn, choice_seed, completion
from molt_hpc.rollout.chat_schema import ChatRequest
from molt_hpc.rollout.chat_stream import stream_reply
from molt_hpc.rollout.engines import EngineLink
from molt_hpc.rollout.tool_calls import forced_prefix

__all__ = ["ChatCall", "ChatServer"]

Reply = dict[str, Any] | AsyncIterator[bytes]
"""A JSON answer, or the server-sent chunks of a streamed one."""


def _problem(
    status: int, message: str, kind: str = "invalid_request_error", param: str | None = None
) -> tuple[int, dict[str, Any]]:
    return status, openai_problem(message, kind, param)


def _error(status: int, message: str, kind: str = "invalid_request_error") -> web.Response:
    return web.json_response(_problem(status, message, kind)[1], status=status)


def unsupported(req: ChatRequest, parser: str) -> tuple[str, str] | None:
    """(param, why) of the first thing in `req` this endpoint cannot honour, or None."""
    if req.stop:
        return "stop", "stop strings are not supported; use max_tokens"
    for name in ("presence_penalty", "frequency_penalty"):  # the trained policy samples without penalties
        if getattr(req, name):
            return name, f"{name} is not supported (the engines sample without penalties); omit it or send 0"
    if req.top_logprobs and not req.logprobs:
        return "top_logprobs", "top_logprobs needs logprobs = true (as in the OpenAI API)"
    if req.choice in ("required", "function") and parser == "none":
        why = f"tool_choice = {req.choice!r} needs a tool-call format: set rollout.tool_parser (hermes, llama3)"
        return "tool_choice", why
    return None


class ChatServer:
    """The endpoint, its per-session record, and its lifecycle (`start` / `close`)."""

    def __init__(
        self,
        tokenizer: Any,
        link: EngineLink,
        cfg: RolloutConfig,
        token: str,
        model: str = "policy",
        routed_experts: bool = False,
    ):
        self.tokenizer, self.link, self.cfg, self.token, self.model = tokenizer, link, cfg, token, model
        self.routed_experts = routed_experts
        """Ask the engines for every call's MoE routing (router replay)."""
        self.calls: dict[str, list[ChatCall]] = defaultdict(list)
        self.failures: dict[str, str] = {}
        self.overrides: dict[str, dict[str, Any]] = {}
        self.url = ""
        app = web.Application(middlewares=[self._auth, openai_errors_middleware], client_max_size=1 << 26)
        for prefix in ("", "/s/{session}"):
            app.router.add_post(prefix + "/v1/chat/completions", self.completions)
            app.router.add_get(prefix + "/v1/models", self.models)
        self._runner = web.AppRunner(app, access_log=None)

    async def start(self, host: str = "127.0.0.1") -> str:
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        self.url = f"http://{host}:{port}"
        return self.url

    async def close(self) -> None:
        await self._runner.cleanup()

    def take(self, session: str) -> tuple[list[ChatCall], str | None]:
        """The calls recorded for `session` and its engine failure, if any; forgets the session."""
        self.overrides.pop(session, None)
        return self.calls.pop(session, []), self.failures.pop(session, None)

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        if not self.authorised(request.headers.get("Authorization")):
            return _error(401, "missing or wrong API key: use the run's token", "authentication_error")
        return await handler(request)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model"}]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        session = request.match_info.get("session") or request.headers.get(SESSION_HEADER)
        status, answer = await self.handle(await read_body(request), session)
        if isinstance(answer, dict):
            return web.json_response(answer, status=status)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        try:
            async for chunk in answer:
                if not await send(resp, chunk):
                    return resp
        finally:
            await answer.aclose()  # a client that left stops the generation
        await send(resp, end=True)
        return resp

    def authorised(self, authorization: str | None) -> bool:
        return hmac.compare_digest((authorization or "").encode(), f"Bearer {self.token}".encode())

    async def handle(self, raw: bytes, session: str | None) -> tuple[int, Reply]:
        """One request as it arrived (raw body, session id from the path or header, if any): checked at
        the edge, then completed. A refusal is a 400 in the OpenAI error shape and records nothing."""
        try:
            req = parse(ChatRequest, loads(raw))
            session = check_session(session) or uuid.uuid4().hex
        except BadRequest as err:
            return _problem(400, str(err), param=err.param)
        return await self.complete(req, session)

    async def complete(self, req: ChatRequest, session: str) -> tuple[int, Reply]:
        """One chat completion for `session`: (HTTP status, the JSON answer, or with `stream` the chunks of a
        200); each choice is recorded as its own call."""
        refused = unsupported(req, self.cfg.tool_parser)
        if refused is not None:
            return _problem(400, refused[1], param=refused[0])
        turn = self._turn(req, session)
        if not isinstance(turn, Turn):
            return turn
        if req.stream:
            return 200, stream_reply(self, turn, self.generate_all, lambda err: self._failed(session, err)[1])
        try:
            outs = await self.generate_all(turn)
        except (EngineError, EngineHTTPError) as err:
            return self._failed(session, err)
        model, parser = self.model, self.cfg.tool_parser
        return 200, completion(self.tokenizer, parser, req, turn.prefix, outs, len(turn.prompt_ids), model)

    def _turn(self, req: ChatRequest, session: str) -> Turn | tuple[int, dict[str, Any]]:
        """The request rendered for the engines, or the 400 that refuses it."""
        prefix = forced_prefix(self.cfg.tool_parser, req.choice, req.choice_name)
        try:
            text = self.tokenizer.apply_chat_template(
                req.template_messages(), tools=req.template_tools(), add_generation_prompt=True, tokenize=False
            )
        except Exception as err:  # the template's refusal (a role or layout it does not know): the caller's to fix
            return _problem(
                400, f"the chat template refused the messages: {type(err).__name__}: {err}", param="messages"
            )
        prompt_ids = list(self.tokenizer(text + prefix, add_special_tokens=False)["input_ids"])
        params, problem = self._sampling_params(req, prompt_ids, session)
        if problem:  # OpenAI's code for it, so an agent can tell a conversation that outgrew the budget
            status, answer = _problem(400, problem, param="messages")
            answer["error"]["code"] = "context_length_exceeded"
            return status, answer
        seeds = [choice_seed(params.get("seed"), i) for i in range(req.n or 1)]
        choices = [{**params, **({"seed": seed} if seed is not None else {})} for seed in seeds]
        return Turn(req, session, prompt_ids, prefix, choices)

    async def generate_all(self, turn: Turn, listeners: list | None = None) -> list[Any]:
        """Every choice's completion (generated together; `listeners[i]` sees choice i's tokens as they come),
        each recorded as its own call of the session once all have finished. A failed choice fails them all."""
        listeners = listeners or [None] * len(turn.params)
        results = await asyncio.gather(
            *(self.link.generate(turn.prompt_ids, params, turn.session, on_tokens=listener)
              for params, listener in zip(turn.params, listeners, strict=True)),
            return_exceptions=True,
        )  # fmt: skip
        for out in results:
            if isinstance(out, BaseException):
                raise out
            if out.finish_reason == "abort":
                raise EngineError("the engine aborted the request")
        calls = [self._record(turn.prompt_ids, out, params) for out, params in zip(results, turn.params, strict=True)]
        self.calls[turn.session] += calls
        return results

    def _failed(self, session: str, err: Exception) -> tuple[int, dict[str, Any]]:
        """The OpenAI error of a failed generation; an engine pool's failure is kept for the session's runner."""
        if isinstance(err, EngineError):
            self.failures[session] = str(err)
            return _problem(502, f"the engine pool failed this call: {err}", "server_error")
        if isinstance(err, EngineHTTPError):
            return _problem(400 if err.status < 500 else 502, err.message)
        raise err

    def _record(self, prompt_ids: list[int], out: Any, params: dict[str, Any]) -> ChatCall:
        ids = list(out.token_ids)
        if len(out.logprobs) != len(ids) or len(out.weight_versions) != len(ids):
            raise EngineError(f"engine returned {len(ids)} tokens but {len(out.logprobs)} log-probs")
        return ChatCall(
            prompt_ids, ids, [float(x) for x in out.logprobs], [int(v) for v in out.weight_versions],
            out.finish_reason, getattr(out, "routed_experts", None), params.get("routed_experts_prompt_start", 0),
        )  # fmt: skip

    def _sampling_params(self, req: ChatRequest, prompt_ids: list[int], session: str) -> tuple[dict, str | None]:
        prompt_len = len(prompt_ids)
        room = self.cfg.max_total_tokens - prompt_len
        if room <= 0:
            cap = self.cfg.max_total_tokens
            return {}, f"the conversation ({prompt_len} tokens) fills rollout.max_total_tokens ({cap})"
        asked = req.max_completion_tokens or req.max_tokens or self.cfg.max_new_tokens
        params = {
            "temperature": self.cfg.temperature if req.temperature is None else req.temperature,
            "top_p": self.cfg.top_p if req.top_p is None else req.top_p,
            "top_k": self.cfg.top_k,
            "stop_token_ids": [self.tokenizer.eos_token_id],
            **({"seed": req.seed} if req.seed is not None else {}),
            **self.overrides.get(session, {}),
        }
        params["max_tokens"] = min(asked, self.cfg.max_new_tokens, room)
        if req.top_logprobs:  # the engines report the k most likely tokens of every step
            params["logprobs"] = req.top_logprobs
        if self.routed_experts:
            params["routed_experts_prompt_start"] = routing_start(self.calls.get(session, []), prompt_ids)
        return params, None
