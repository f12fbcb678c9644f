"""The OpenAI-compatible chat endpoint that chat-mode agents talk to, served on top of the engines.

`POST /v1/chat/completions` (and `/s/<session>/v1/chat/completions`, so any OpenAI client keeps
an episode on one engine without custom headers; `X-Session-ID` works too): the messages (and the
`tools`) go through the tokenizer's chat template, the router generates with the session id, the
reply is decoded with special tokens skipped and, when the request offered tools, read for tool calls
by `rollout.tool_parser` (`molt_hpc.rollout.tool_calls`). Every call is recorded per session as a
`ChatCall` (prompt ids, completion ids, the engine's per-token log-probs and weight versions, MoE
routing under router replay) for `ChatAgentRunner` to turn into a trajectory
(`molt_hpc.agents.chat_trace`). `logprobs: true` returns those same log-probs to the agent. Requests
need the run's token as the API key. Per-session overrides (greedy evaluation) apply to every call.
"""

import hmac
import time
import uuid
from collections import defaultdict
from typing import Any

from aiohttp import web

from molt_hpc.agents.calls import EngineError
from molt_hpc.agents.chat_trace import ChatCall, routing_start
from molt_hpc.config.rollout import RolloutConfig
from molt_hpc.engine.client import SESSION_HEADER, EngineHTTPError
from molt_hpc.log import get_logger
from molt_hpc.protocol.edge import (
    BadRequest,
    check_session,
    loads,
    openai_errors_middleware,
    openai_problem,
    parse,
    read_body,
)
from molt_hpc.rollout.chat_schema import ChatRequest
from molt_hpc.rollout.engines import EngineLink
from molt_hpc.rollout.tool_calls import forced_prefix, parse_reply

__all__ = ["ChatCall", "ChatServer"]


def _problem(
    status: int, message: str, kind: str = "invalid_request_error", param: str | None = None
) -> tuple[int, dict[str, Any]]:
    return status, openai_problem(message, kind, param)


def _error(status: int, message: str, kind: str = "invalid_request_error") -> web.Response:
    return web.json_response(_problem(status, message, kind)[1], status=status)


def unsupported(req: ChatRequest, parser: str) -> tuple[str, str] | None:
    """(param, why) of the first thing in `req` this endpoint cannot honour, or None."""
    if (req.n or 1) != 1 or req.stream:
        return ("n" if (req.n or 1) != 1 else "stream"), "only n = 1 without streaming is served"
    if req.stop:
        return "stop", "stop strings are not supported; use max_tokens"
    for name in ("presence_penalty", "frequency_penalty"):  # the trained policy samples without penalties
        if getattr(req, name):
            return name, f"{name} is not supported (the engines sample without penalties); omit it or send 0"
    if req.top_logprobs:
        return "top_logprobs", "top_logprobs is not supported (the engines return the sampled token's); send 0"
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

    async def completions(self, request: web.Request) -> web.Response:
        session = request.match_info.get("session") or request.headers.get(SESSION_HEADER)
        status, answer = await self.handle(await read_body(request), session)
        return web.json_response(answer, status=status)

    def authorised(self, authorization: str | None) -> bool:
        return hmac.compare_digest((authorization or "").encode(), f"Bearer {self.token}".encode())

    async def handle(self, raw: bytes, session: str | None) -> tuple[int, dict[str, Any]]:
        """One request as it arrived (raw body, session id from the path or header, if any): checked at
        the edge, then completed. A refusal is a 400 in the OpenAI error shape and records nothing."""
        try:
            req = parse(ChatRequest, loads(raw))
            session = check_session(session) or uuid.uuid4().hex
        except BadRequest as err:
            return _problem(400, str(err), param=err.param)
        return await self.complete(req, session)

    async def complete(self, req: ChatRequest, session: str) -> tuple[int, dict[str, Any]]:
        """One chat completion for `session`: (HTTP status, JSON answer); the call is recorded."""
        refused = unsupported(req, self.cfg.tool_parser)
        if refused is not None:
            return _problem(400, refused[1], param=refused[0])
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
        try:
            out = await self.link.generate(prompt_ids, params, session)
            if out.finish_reason == "abort":
                raise EngineError("the engine aborted the request")
            call = self._record(prompt_ids, out, params)
        except EngineError as err:
            self.failures[session] = str(err)
            return _problem(502, f"the engine pool failed this call: {err}", "server_error")
        except EngineHTTPError as err:
            return _problem(400 if err.status < 500 else 502, err.message)
        self.calls[session].append(call)
        return 200, self._answer(req, prefix, out, len(prompt_ids))

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
        if self.routed_experts:
            params["routed_experts_prompt_start"] = routing_start(self.calls.get(session, []), prompt_ids)
        return params, None

    def _answer(self, req: ChatRequest, prefix: str, out: Any, prompt_len: int) -> dict[str, Any]:
        text = prefix + self.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        get_logger().debug("chat completion of %d tokens", len(out.token_ids))
        message: dict[str, Any] = {"role": "assistant", "content": text}
        finish = out.finish_reason
        parsed = parse_reply(self.cfg.tool_parser, text, req.offered, req.choice, req.choice_name)
        if parsed is not None:
            content, calls = parsed
            message = {"role": "assistant", "content": content, "tool_calls": [c.openai() for c in calls]}
            finish = "tool_calls"
        choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish}
        if req.logprobs:
            choice["logprobs"] = {"content": self._logprobs(out)}
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": [choice],
            "usage": {
                "prompt_tokens": prompt_len,
                "completion_tokens": len(out.token_ids),
                "total_tokens": prompt_len + len(out.token_ids),
            },
        }

    def _logprobs(self, out: Any) -> list[dict[str, Any]]:
        """OpenAI's `logprobs.content`: every token the engine produced (its stop token too) with the
        engine's log-prob, the one the trace trains with."""
        pieces = [self.tokenizer.decode([t]) for t in out.token_ids]
        return [
            {"token": p, "logprob": float(lp), "bytes": list(p.encode()), "top_logprobs": []}
            for p, lp in zip(pieces, out.logprobs, strict=True)
        ]
