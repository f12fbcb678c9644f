"""Async client of the engine HTTP protocol (the built-in engine, `vllm serve`, or the router in front).

Every call carries the run's token. Images (vision-language models) ride in one molt-hpc field of the
generate body, `"mm": {"images": [data URIs], "spans": [[offset, length], ...]}`: each image and the run
of (already expanded) placeholder tokens its features fill; the builtin engine reads it as it is, the
vLLM front turns it into vLLM's render + `features` (`molt_hpc.engine.vllm.mm`).
A non-2xx answer raises `EngineHTTPError` with the status and the server's message, so callers can
retry 5xx and connection errors and fail fast on 4xx.
"""

from dataclasses import dataclass
from typing import Any

import aiohttp
import numpy as np

from molt_hpc.engine.routing import decode_routing

GENERATE_PATH = "/inference/v1/generate"
SESSION_HEADER = "X-Session-ID"


class EngineHTTPError(RuntimeError):
    """An engine (or the router) answered with an error status."""

    def __init__(self, status: int, message: str, url: str):
        super().__init__(f"{url}: HTTP {status}: {message}")
        self.status = status
        self.message = message
        self.url = url


@dataclass(frozen=True)
class GenerateResult:
    """One completion: the sampled tokens with their processed log-probs and policy versions."""

    token_ids: list[int]
    """Sampled token ids (a stop token, when one ended the request, is included)."""
    logprobs: list[float]
    """Log-prob of each sampled token after temperature/top-k/top-p processing."""
    finish_reason: str
    """`stop` (EOS or a stop token), `length` (max_tokens or max_model_len), `abort`."""
    weight_versions: list[int]
    """Weight version that produced each token (differs within a request that straddled a refit)."""
    weight_version: int
    """The engine's weight version when the request ended."""
    routed_experts: np.ndarray | None = None
    """MoE routing capture (vLLM's `routed_experts`, decoded): `[prompt + generated - 1 - prompt_start,
    layers, top_k]` expert ids of every forwarded position; None when the engine does not capture."""
    top_logprobs: list[list[tuple[int, float]]] | None = None
    """With `logprobs` k > 0 asked for: each token's k most likely (token id, log-prob) pairs, else None."""


def auth_headers(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def request_json(
    session: aiohttp.ClientSession,
    method: str,
    url: str,
    *,
    token: str,
    json: Any = None,
    params: dict[str, str] | None = None,
    headers: dict[str, str] | None = None,
    timeout: float | None = None,
) -> dict[str, Any]:
    all_headers = {**auth_headers(token), **(headers or {})}
    client_timeout = aiohttp.ClientTimeout(total=timeout) if timeout else None
    kwargs: dict[str, Any] = {"json": json, "params": params, "headers": all_headers}
    if client_timeout is not None:
        kwargs["timeout"] = client_timeout
    async with session.request(method, url, **kwargs) as resp:
        if resp.status >= 300:
            text = await resp.text()
            try:
                message = (await resp.json(content_type=None)).get("error", text)
            except ValueError:  # not JSON (a proxy's HTML page): keep the raw text
                message = text
            raise EngineHTTPError(resp.status, str(message), url)
        return await resp.json(content_type=None)


async def generate(
    session: aiohttp.ClientSession,
    url: str,
    token_ids: list[int],
    sampling_params: dict[str, Any],
    *,
    token: str,
    session_id: str | None = None,
    timeout: float | None = None,
    images: list[Any] | None = None,
) -> GenerateResult:
    """Generate one completion of `token_ids` at `url` (an engine or the router's base URL).

    `session_id` goes in the `X-Session-ID` header: the router sends every call of one session to
    the same engine (its KV cache). `sampling_params` uses vLLM's field names (`temperature`,
    `top_p`, `top_k`, `max_tokens`, `stop_token_ids`, `seed`, `ignore_eos`, ...). `images` are the
    `TraceImage`s placed in `token_ids` (vision-language models).
    """
    headers = {SESSION_HEADER: session_id} if session_id else None
    body: dict[str, Any] = {"token_ids": list(token_ids), "sampling_params": sampling_params}
    if images:
        body["mm"] = mm_field(images)
    data = await request_json(
        session, "POST", url.rstrip("/") + GENERATE_PATH, token=token, json=body, headers=headers, timeout=timeout
    )
    return parse_generate_response(data)


def mm_field(images: list[Any]) -> dict[str, Any]:
    """The generate body's `mm` field of `TraceImage`s: data URIs and (offset, length) spans."""
    from molt_hpc.vision.images import data_uri

    return {"images": [data_uri(im.data) for im in images], "spans": [[im.offset, im.length] for im in images]}


def parse_generate_response(data: dict[str, Any]) -> GenerateResult:
    """A `GenerateResult` from the JSON of `/inference/v1/generate` (first choice)."""
    choice = data["choices"][0]
    content = (choice.get("logprobs") or {}).get("content") or []
    token_ids = list(choice["token_ids"])
    version = int(data.get("weight_version", 0))
    versions = choice.get("weight_versions")
    routed = choice.get("routed_experts")
    top = [entry["top_logprobs"] for entry in content] if content and "top_logprobs" in content[0] else None
    return GenerateResult(
        token_ids=token_ids,
        logprobs=[float(entry["logprob"]) for entry in content],
        finish_reason=choice["finish_reason"],
        weight_versions=[int(v) for v in versions] if versions is not None else [version] * len(token_ids),
        weight_version=version,
        routed_experts=None if routed is None else decode_routing(routed),
        top_logprobs=None if top is None else [[_alternative(a) for a in step] for step in top],
    )


def _alternative(entry: dict[str, Any]) -> tuple[int, float]:
    """(token id, log-prob) of a `top_logprobs` entry: the builtin engine's `token_id`, or vLLM's token as
    `"token_id:N"` (its `--return-tokens-as-token-ids` spelling, the one its generate route uses)."""
    tid = entry.get("token_id")
    if tid is None:
        tid = str(entry["token"]).removeprefix("token_id:")
    return int(tid), float(entry["logprob"])


async def health(session: aiohttp.ClientSession, url: str, *, token: str, timeout: float = 5.0) -> dict[str, Any]:
    """The engine's `/health` answer (`{"status": "ok", "weight_version": v, ...}`)."""
    return await request_json(session, "GET", url.rstrip("/") + "/health", token=token, timeout=timeout)


async def pause(
    session: aiohttp.ClientSession, url: str, *, token: str, mode: str = "keep", timeout: float | None = None
) -> dict[str, Any]:
    """Pause generation: `abort` in-flight requests, `wait` for them to finish, or `keep` them frozen."""
    return await request_json(
        session, "POST", url.rstrip("/") + "/pause", token=token, params={"mode": mode}, timeout=timeout
    )


async def resume(
    session: aiohttp.ClientSession, url: str, *, token: str, timeout: float | None = None, steps: int | None = None
) -> dict[str, Any]:
    """Resume generation after `pause` (frozen requests continue, held ones start); with `steps` (built-in
    engines), freeze them again after that many steps."""
    body = None if steps is None else {"steps": steps}
    return await request_json(session, "POST", url.rstrip("/") + "/resume", token=token, timeout=timeout, json=body)
