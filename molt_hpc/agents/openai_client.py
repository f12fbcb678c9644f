"""Ready OpenAI clients for chat-mode agents: one connection pool per rollout process, cheap per episode.

Building an `openai.AsyncOpenAI` creates an HTTP client, and that creates a TLS context (it loads
the CA bundle): 60–100 ms on a loaded 2-core machine, spent on the orchestrator's event loop, so
a client per episode stalls every other episode in flight. A client built on an existing HTTP
client costs ~0.1 ms. `OpenAIPool` owns that one HTTP client (keep-alive connections to the
chat endpoint included) and hands each episode an `AsyncOpenAI` bound to its session's base URL.

`openai` is an optional dependency (`pip install 'molt-hpc[chat]'`); without it, using
`ctx.openai` or `ctx.http_client` raises a `ValueError` that says so, and `ctx.client` (the
minimal built-in client) still works.
"""

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

    def __init__(self) -> None:
        self._http: Any = None
        self.available = importlib.util.find_spec("openai") is not None

    @property
    def http_client(self) -> Any:
        """The shared `httpx` client (`openai.DefaultAsyncHttpxClient`), made on first use."""
        if not self.available:
            return MissingOpenAI("ctx.http_client")
        if self._http is None:
            import openai

            self._http = openai.DefaultAsyncHttpxClient()
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
            await self._http.aclose()
            self._http = None
