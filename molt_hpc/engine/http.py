"""HTTP pieces shared by the engine and the router (no torch here: the router stays light).

The run token check every route passes through, the error middleware that turns user errors into
400s without taking the server down, and JSON body reading with a clear message.
"""

import hmac
import json
from typing import Any

from aiohttp import web

from molt_hpc.log import get_logger


def error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


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


@web.middleware
async def errors_middleware(request: web.Request, handler):
    """User errors become 400 with their message; anything else is a 500 that is logged, not fatal."""
    try:
        return await handler(request)
    except web.HTTPException:
        raise
    except ValueError as err:  # bad input: tell the caller what to change
        return error(400, str(err))
    except Exception as err:  # the server keeps serving; the failure is reported and logged
        get_logger().exception("%s %s failed", request.method, request.path)
        return error(500, f"{type(err).__name__}: {err}")


async def read_json(request: web.Request) -> Any:
    """The decoded JSON body ({} when empty); invalid JSON is a `ValueError` (→ 400)."""
    raw = await request.read()
    if not raw:
        return {}
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"the body is not valid JSON: {err}") from None
