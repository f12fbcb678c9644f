"""HTTP pieces every server of a run shares (no torch here: the router and the front stay light).

The run token check every route passes through; the one edge where a body becomes a typed request
(`read_json` refuses what is not UTF-8 JSON with finite numbers, `parse` validates it against a
pydantic model); the error middleware that turns a refusal into a 4xx with its reason without
taking the server down; route-path and session-id checks for the servers that forward; `send`, the
write of a streamed answer that takes a client that left for what it is. A refusal happens before a
handler acts, so a refused request changes nothing.

Two error shapes: the engine protocol's `{"error": "<message>"}` (engine, router, scorer, vLLM
front) and the OpenAI one, `{"error": {"message", "type", "param", "code"}}` (the chat endpoint),
which the `openai` client raises as `BadRequestError`.
"""

import hmac
import json
import math
import posixpath
import re
from typing import Any, TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from molt_hpc.log import get_logger

M = TypeVar("M", bound=BaseModel)
SESSION_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
"""Session ids: a fixed alphabet and length, so one never carries a path, a header break or markup."""
CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class BadRequest(ValueError):
    """A request refused before anything was done (→ 400); `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


def openai_problem(message: str, kind: str = "invalid_request_error", param: str | None = None) -> dict[str, Any]:
    """The OpenAI API's error body."""
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def openai_error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
    return web.json_response(openai_problem(message, kind, param), status=status)


def token_middleware(token: str, open_health: bool = False):
    """Every route needs `Authorization: Bearer <run token>` (cluster nodes are shared).

    With `open_health`, `GET /health` without the token answers `{"status": "ok"}` and nothing
    else: vLLM's router health-checks engines without credentials (`router.kind = "vllm-router"`).
    """
    expected = f"Bearer {token}".encode()

    @web.middleware
    async def check(request: web.Request, handler):
        got = request.headers.get("Authorization", "").encode()
        if open_health and request.path == "/health" and request.method == "GET" and got != expected:
            return web.json_response({"status": "ok"})  # liveness only: no state without the token
        if not hmac.compare_digest(got, expected):
            return error(401, "missing or wrong token: send 'Authorization: Bearer <token>' (rendezvous/token)")
        return await handler(request)

    return check


def errors_middleware_for(respond):
    """User errors become 400 answered by `respond(status, message, param)`; anything else is a 500
    that is logged, not fatal."""

    @web.middleware
    async def errors(request: web.Request, handler):
        try:
            return await handler(request)
        except web.HTTPRequestEntityTooLarge:  # over client_max_size, in this server's error shape
            limit = request.client_max_size
            return respond(413, f"the body is over this server's limit of {limit} bytes: send a smaller one", None)
        except web.HTTPException:
            raise
        except ValueError as err:  # bad input: tell the caller what to change
            return respond(400, str(err), getattr(err, "param", None))
        except Exception as err:  # the server keeps serving; the failure is reported and logged
            get_logger().exception("%s %s failed", request.method, request.path)
            return respond(500, f"{type(err).__name__}: {err}", None)

    return errors


errors_middleware = errors_middleware_for(lambda status, message, _param: error(status, message))
openai_errors_middleware = errors_middleware_for(
    lambda status, message, param: openai_error(
        status, message, "invalid_request_error" if status < 500 else "server_error", param
    )
)


def _refuse_constant(name: str) -> Any:
    raise BadRequest(f"the body holds {name}, which JSON does not have: every number must be finite")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise BadRequest(f"the number {text[:40]} is too large for a float: every number must be finite")
    return value


def _check_strings(value: Any) -> None:
    """Lone UTF-16 surrogates (`"\\ud800"`) decode to strings no encoder can write back: refuse them."""
    if isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError:
            raise BadRequest("the body holds a lone UTF-16 surrogate escape: send valid Unicode text") from None
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_strings(k)
            _check_strings(v)
    elif isinstance(value, list):
        for v in value:
            _check_strings(v)


def loads(raw: bytes) -> Any:
    """Decode a JSON body strictly ({} when empty): UTF-8 only, finite numbers only (no `NaN`,
    `Infinity`, nor `1e999`, which Python would read as inf), valid Unicode; else a `BadRequest`."""
    if not raw:
        return {}
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise BadRequest(f"the body is not UTF-8 (byte {err.start}): send JSON encoded as UTF-8") from None
    try:
        value = json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)
    except BadRequest:
        raise
    except ValueError as err:  # JSONDecodeError, or an integer literal too long to convert
        raise BadRequest(f"the body is not valid JSON: {err}") from None
    if "\\u" in text or "\\U" in text:  # only escapes can make a lone surrogate: skip the walk otherwise
        _check_strings(value)
    return value


async def read_body(request: web.Request) -> bytes:
    """The raw body; one whose declared length is over the server's `client_max_size` is refused
    (→ 413) before a byte of it is read, one that grows past it (chunked) as soon as it does."""
    if request.content_length is not None and request.content_length > request.client_max_size:
        raise web.HTTPRequestEntityTooLarge(request.client_max_size, request.content_length)
    return await request.read()


async def read_json(request: web.Request) -> Any:
    """The strictly decoded JSON body (`loads`); a refusal is a `BadRequest` (→ 400), or a 413 (`read_body`)."""
    return loads(await read_body(request))


def parse(model: type[M], body: Any, what: str = "the body") -> M:
    """`body` validated against `model`; the first problem is a `BadRequest` naming the field."""
    if not isinstance(body, dict):
        raise BadRequest(f"{what} must be a JSON object, got {type(body).__name__}")
    try:
        return model.model_validate(body)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(x) for x in first["loc"]) or None
        got = repr(first.get("input"))[:80]
        raise BadRequest(f"{where or what}: {first['msg']} (got {got})", where) from None


def check_session(session: str | None) -> str | None:
    """`session` if it is a valid session id (or None); else a `BadRequest` that does not echo it."""
    if session is not None and not SESSION_ID.match(session):
        raise BadRequest("the session id must be 1-128 characters of A-Z a-z 0-9 . _ : -", "session")
    return session


def forwardable_path(request: web.Request, prefix: str) -> str:
    """The request's path if it is a plain path under `prefix` (no `.` or `..` segment, no encoded
    dot, slash or backslash, no control character, no empty segment); else a `BadRequest`. A proxy
    forwards only such paths, so nothing it forwards is normalised into another route upstream."""
    raw = request.raw_path.split("?", 1)[0]
    path = request.path
    if CONTROL.search(raw) or CONTROL.search(path) or "\\" in path:
        raise BadRequest("the path holds a control character or a backslash")
    if re.search(r"%(2e|2f|5c)", raw, re.IGNORECASE) or posixpath.normpath(path) != path or "//" in path:
        raise BadRequest(f"the path must be a plain path under {prefix} (no '.', '..', or encoded separators)")
    if not path.startswith(prefix):
        raise BadRequest(f"only paths under {prefix} are forwarded")
    return path


async def send(resp: web.StreamResponse, data: bytes = b"", *, end: bool = False) -> bool:
    """Write `data` to the client of a streamed answer, then (`end`) the end of the stream; False when the client
    has left. A reader may close once it has what it needs, before the stream's end (a rollout that has its
    answer, a router whose own client left): nothing failed, so nothing is logged as a failure."""
    try:
        await (resp.write_eof(data) if end else resp.write(data))
    except ConnectionResetError:  # aiohttp's "Cannot write to closing transport" is one
        get_logger().debug("the client left before the end of its streamed answer")
        return False
    return True
