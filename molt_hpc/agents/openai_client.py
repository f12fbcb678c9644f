"""Ready OpenAI clients for chat-mode agents: one HTTP client per rollout process, cheap per episode.

Building an `openai.AsyncOpenAI` creates an HTTP client, and that creates a TLS context (it loads
the CA bundle): 60–100 ms on a loaded 2-core machine, spent on the orchestrator's event loop, so
a client per episode stalls every other episode in flight. A client built on an existing HTTP
client costs ~0.1 ms. `OpenAIPool` owns that one HTTP client and hands each episode an
`AsyncOpenAI` bound to its session's base URL.

The chat endpoint lives in this same process, so the shared client reaches it without a socket:
an httpx transport mounted on the endpoint's address passes each request to `ChatServer.handle`
(the token still checked; a streamed reply's chunks pass as the response's body), which saves the HTTP
client and server work of every call. Every
other address (a remote API an agent also calls) goes through the SDK's own transport, on
aiohttp where the SDK has it (httpx's connection pool scans every connection per request, which
with a hundred episodes in flight costs more than the requests).

`openai` is an optional dependency (`pip install 'molt-hpc[chat]'`); without it, using
`ctx.openai` or `ctx.http_client` raises a `ValueError` that says so, and `ctx.client` (the
minimal built-in client) still works.
"""

import importlib
import importlib.util
from typing import Any

INSTALL_HINT = "pip install 'molt-hpc[chat]'"


class MissingOpenAI:
    """Stands in for `ctx.openai` / `ctx.http_client` when the `openai` package is not installed."""

    def __init__(self, what: str):
        self._what = what

    def __getattr__(self, name: str) -> Any:
        raise ValueError(f"{self._what} needs the openai package; install it: {INSTALL_HINT}")


class OpenAIPool:
    """One shared HTTP client; `client(base_url, api_key)` is an `AsyncOpenAI` on top of it."""

    def __init__(self, server: Any = None) -> None:
        self.server = server
        """The in-process `ChatServer` (None: every request goes over the network)."""
        self._http: Any = None
        self.available = importlib.util.find_spec("openai") is not None

    @property
    def http_client(self) -> Any:
        """The shared httpx client (the SDK's defaults), made on first use."""
        if not self.available:
            return MissingOpenAI("ctx.http_client")
        if self._http is None:
            self._http = _shared_http_client(self.server)
        return self._http

    def client(self, base_url: str, api_key: str) -> Any:
        """An `AsyncOpenAI` for one episode. No retries: a failed call fails the episode anyway
        (the endpoint records it), so a retry would only add its back-off to a lost sample."""
        if not self.available:
            return MissingOpenAI("ctx.openai")
        import openai

        return openai.AsyncOpenAI(base_url=base_url, api_key=api_key, http_client=self.http_client, max_retries=0)

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close_shared()
            self._http = None


def _httpx() -> Any:
    """The httpx module the installed SDK is built on (`httpx` for openai 2, `httpx2` for openai 3)."""
    import openai

    base = next(c for c in openai.DefaultAsyncHttpxClient.__mro__ if c.__name__ == "AsyncClient")
    return importlib.import_module(base.__module__.split(".")[0])


def _in_process_transport(server: Any) -> Any:
    """An httpx transport that answers chat completions by calling `server.complete` directly."""
    httpx = _httpx()

    class InProcess(httpx.AsyncBaseTransport):
        async def handle_async_request(self, request: Any) -> Any:
            path = request.url.path
            if request.method != "POST" or not path.endswith("/v1/chat/completions"):
                return httpx.Response(404, json={"error": {"message": f"no route {request.method} {path}"}})
            if not server.authorised(request.headers.get("authorization")):
                message = "missing or wrong API key: use the run's token"
                return httpx.Response(401, json={"error": {"message": message, "type": "authentication_error"}})
            parts = path.split("/")
            session = parts[parts.index("s") + 1] if path.startswith("/s/") else request.headers.get("x-session-id")
            status, answer = await server.handle(await request.aread(), session)  # the endpoint's own edge checks
            if isinstance(answer, dict):
                return httpx.Response(status, json=answer)
            return httpx.Response(status, headers={"content-type": "text/event-stream"}, stream=Chunks(answer))

    class Chunks(httpx.AsyncByteStream):
        """A streamed reply's server-sent chunks; closing it (the agent stopped reading) stops the reply."""

        def __init__(self, chunks: Any):
            self.chunks = chunks

        async def __aiter__(self):
            async for chunk in self.chunks:
                yield chunk

        async def aclose(self) -> None:
            await self.chunks.aclose()

    return InProcess()


def _shared_http_client(server: Any) -> Any:
    """The SDK's default async HTTP client (on aiohttp when the SDK can make one: aiohttp is a
    dependency of ours), with the chat endpoint mounted in-process when `server` is given.

    Its `aclose` leaves it open: `AsyncOpenAI.close()` (and `async with AsyncOpenAI(...,
    http_client=ctx.http_client)`) closes the HTTP client it was given, which would shut the pool
    under every other episode. The pool closes it at the end."""
    import openai

    mounts = {server.url: _in_process_transport(server)} if server is not None and server.url else {}
    for base in (openai.DefaultAioHttpClient, openai.DefaultAsyncHttpxClient):

        class SharedHttpClient(base):
            async def aclose(self) -> None:
                pass

            async def close_shared(self) -> None:
                await super().aclose()

        try:
            return SharedHttpClient(mounts=mounts)
        except RuntimeError:  # this SDK has no aiohttp transport (openai 2 without httpx-aiohttp)
            continue
    raise AssertionError("openai.DefaultAsyncHttpxClient always constructs")
