"""The front of a vLLM engine: our token check and weight-version stamping in front of `vllm serve`.

vLLM's dev routes (/pause, the weight-transfer routes) are not token-guarded, so `vllm serve` listens on
127.0.0.1 only and every outside call comes through here. Generate requests get vLLM's sampling settings for
our protocol (the sampled token's log-prob, no detokenizing) and their answers the weight version(s) that
produced them, which vLLM does not report; `/finish_weight_update` sets that version. `/health` also says
where vLLM's workers run (`place`, from our worker extension), so the trainer can pick CUDA IPC for an engine
on its own GPU; `/collective_rpc` is forwarded for our extension's `molt_*` methods only.
`/finish_weight_update` closes vLLM's native weight-transfer session when `/start_weight_update` opened one
(the NCCL refit); a shared-memory refit loads through the extension and has none, so then only the version is
stamped. A request with images (our `mm` field) becomes vLLM's render + `features` (`vllm_mm.py`). In a LoRA
run `/molt_load_adapter` is the refit: each version's adapter loads under a name of its own and new requests
get it (`adapters.py`). With `stream: true` vLLM's streamed answer is passed on in the builtin engine's events
(`streamed.py`), so a dying vLLM leaves its caller every token it sent (under router replay a whole answer
instead: `Front.routed`). Every body is checked at the edge (`http.py`, `requests.py`) before anything is
forwarded; the rest passes as it is. No torch here: this process only relays.
"""

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from molt_hpc.engine.vllm import mm as vllm_mm
from molt_hpc.engine.vllm.adapters import AdapterSlots, adapter_name
from molt_hpc.engine.vllm.streamed import relay_stream
from molt_hpc.log import get_logger
from molt_hpc.protocol.edge import (
    error,
    errors_middleware,
    forwardable_path,
    loads,
    parse,
    read_body,
    read_json,
    token_middleware,
)
from molt_hpc.protocol.requests import (
    AdapterRequest,
    FinishRequest,
    GenerateRequest,
    InitRequest,
    PauseRequest,
    RpcRequest,
    UpdateRequest,
    VllmResumeRequest,
)

GENERATE_PATH = "/inference/v1/generate"
RENDER_PATH = "/v1/chat/completions/render"
FORWARDED = (
    "/pause",
    "/resume",
    "/is_paused",
    "/init_weight_transfer_engine",
    "/update_weights",
    "/reset_prefix_cache",
    "/get_world_size",
)
# The builtin engine's default (engine/sampling.py); vLLM's server would default to the rest of max_model_len.
DEFAULT_MAX_TOKENS = 16
HEALTH_TIMEOUT_S = 10.0
BODY_MODELS = {
    "/init_weight_transfer_engine": InitRequest,
    "/update_weights": UpdateRequest,
    "/pause": PauseRequest,
    "/resume": VllmResumeRequest,
}
"""Forwarded routes whose bodies are typed: refused here, they never reach vLLM (nor drop its refit channel)."""
RPC_PREFIX = "molt_"
"""`/collective_rpc` reaches only our worker extension's methods, never the worker's own."""


@dataclass
class Front:
    """What the handlers share: where vLLM listens, the token, and the weight version we stamp."""

    upstream: str
    token: str
    index: int
    version: int = 0
    on_version: Callable[[int], None] | None = None
    session: aiohttp.ClientSession | None = None
    place: dict[str, Any] = field(default_factory=dict)
    """Where vLLM's workers run (`host_id`, `device_uuids`), for the trainer's transport choice."""
    native_session: bool = False
    """A `/start_weight_update` went through to vLLM and its `/finish_weight_update` is due."""
    open_health: bool = False
    """Answer a tokenless `GET /health` with liveness only (vLLM's router checks engines that way)."""
    routed: bool = False
    """vLLM captures MoE routing (router replay). vLLM joins a request's routing when it finishes and its
    streamed chunks may carry none, so a streamed request is then answered whole (its routing kept; a vLLM
    that dies mid-answer costs the request its tokens, which start again elsewhere)."""
    adapters: AdapterSlots | None = None
    """A LoRA run's engine: which adapter each request gets (`adapters.py`); None serves the model itself."""

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}


def normalise_generate(body: object) -> dict[str, Any]:
    """A generate body as vLLM should get it: the sampled token's log-prob always returned
    (`logprobs` 0 when unset), top-k off spelled -1, no detokenizing (we send and read token ids); a
    streamed one asks for one completion."""
    if not isinstance(body, dict):
        raise ValueError("the body must be a JSON object with 'token_ids' and 'sampling_params'")
    sp = body.get("sampling_params")
    if sp is None:
        sp = {}
    if not isinstance(sp, dict):
        raise ValueError(f"sampling_params must be a JSON object, got {sp!r}")
    sp = dict(sp)
    if body.get("stream") and sp.get("n", 1) != 1:
        raise ValueError("stream = true streams one completion: send sampling_params.n = 1, or stream = false")
    if sp.get("logprobs") is None:
        sp["logprobs"] = 0
    if sp.get("top_k") == 0:
        sp["top_k"] = -1
    sp.setdefault("max_tokens", DEFAULT_MAX_TOKENS)
    sp["detokenize"] = False
    out = {k: v for k, v in body.items() if k != "output_mode"}  # ours only: vLLM always answers tokens
    out["sampling_params"] = sp
    return out


def stamp_versions(data: dict[str, Any], start: int, now: int) -> dict[str, Any]:
    """Add `weight_version` (now) and per-token `weight_versions` to vLLM's generate answer. A request
    that straddled a weight update is stamped with its start version: staleness is judged on the oldest
    weights that may have produced a token."""
    data["weight_version"] = now
    for choice in data.get("choices") or []:
        choice["weight_versions"] = [start] * len(choice.get("token_ids") or [])
    return data


def stamped_body(raw: bytes, start: int, now: int) -> bytes:
    """vLLM's generate answer with our version stamps, as bytes. When no refit finished while the request
    ran (start == now, nearly always) every token has version `now`, which the protocol's readers assume
    where `weight_versions` is absent: `weight_version` goes in front of vLLM's own bytes, with no decoding
    and re-encoding of its (per-token log-prob) JSON. Otherwise the answer is decoded and stamped."""
    head = raw.lstrip()
    if start == now and head.startswith(b"{") and not head[1:].lstrip().startswith(b"}"):
        return b'{"weight_version": %d, ' % now + head[1:]
    return json.dumps(stamp_versions(json.loads(raw), start, now)).encode()


def upstream_message(raw: bytes) -> str:
    """The message of a vLLM error body (`{"error": {"message"}}`, FastAPI's `{"detail"}`, or text)."""
    text = raw.decode(errors="replace")
    try:
        data = json.loads(text)
    except json.JSONDecodeError:  # not JSON: the raw text is the message
        return text
    if isinstance(data, dict):
        err = data.get("error", data.get("detail"))
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if err is not None:
            return err if isinstance(err, str) else json.dumps(err)
    return text


async def call_upstream(
    front: Front, method: str, path_qs: str, content_type: str | None = None, **kwargs: Any
) -> tuple[int, bytes, str]:
    """(status, body, content type) of one call to vLLM; no connection (or a timeout the caller set) is a 502."""
    assert front.session is not None, "the front's client session opens on startup"
    headers = {**front.headers, **({"Content-Type": content_type} if content_type else {})}
    try:
        async with front.session.request(method, front.upstream + path_qs, headers=headers, **kwargs) as resp:
            return resp.status, await resp.read(), resp.headers.get("Content-Type", "application/json")
    except (aiohttp.ClientConnectionError, TimeoutError) as err:  # vLLM down or stuck: a 502 callers can retry
        return (
            502,
            json.dumps({"error": f"vLLM at {front.upstream} is not answering: {err}"}).encode(),
            "application/json",
        )


def relay(status: int, body: bytes, content_type: str) -> web.Response:
    return web.Response(status=status, body=body, headers={"Content-Type": content_type})


FRONT = web.AppKey("front", Front)


def front_of(request: web.Request) -> Front:
    return request.app[FRONT]


async def open_session(app: web.Application) -> None:
    # No total timeout: /update_weights blocks for a whole transfer, a long generate for minutes.
    app[FRONT].session = aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=None), connector=aiohttp.TCPConnector(limit=0)
    )


async def close_session(app: web.Application) -> None:
    if app[FRONT].session is not None:
        await app[FRONT].session.close()


async def generate(request: web.Request) -> web.StreamResponse:
    front, decoded = front_of(request), await read_json(request)
    parse(GenerateRequest, decoded, "the body (with 'token_ids' and 'sampling_params')")
    body = normalise_generate(decoded)
    if front.adapters is None:
        return await generate_with(request, front, body)
    name = front.adapters.take()  # with the version stamp below: no await between them
    if name is not None:
        body["model"] = name
    try:
        return await generate_with(request, front, body)
    finally:
        for old in front.adapters.release(name):
            await unload_adapter(front, old)


async def generate_with(request: web.Request, front: Front, body: dict[str, Any]) -> web.StreamResponse:
    start = front.version
    mm = body.pop("mm", None)
    if mm is not None:  # images: vLLM's processor renders them, our token ids place them
        status, raw, _ = await call_upstream(front, "POST", RENDER_PATH, json=vllm_mm.render_request(mm))
        if status >= 300:
            return error(status, f"rendering the images: {upstream_message(raw)}")
        body["features"] = vllm_mm.features(json.loads(raw), mm, body.get("token_ids") or [], start)
    if body.get("stream") and not front.routed:
        return await generate_streamed(request, front, body, start)
    body.pop("stream", None)  # a whole answer, which a streamed call takes too (`Front.routed`)
    status, raw, _ = await call_upstream(front, "POST", GENERATE_PATH, json=body)
    if status >= 300:
        return error(status, upstream_message(raw))
    return web.Response(body=stamped_body(raw, start, front.version), content_type="application/json")


async def generate_streamed(request: web.Request, front: Front, body: dict[str, Any], start: int) -> web.StreamResponse:
    """`stream: true`: vLLM's streamed answer passed on in the builtin engine's events (`streamed.py`); an
    error before the first chunk keeps its status, as for a whole answer."""
    assert front.session is not None, "the front's client session opens on startup"
    try:
        upstream = await front.session.post(front.upstream + GENERATE_PATH, json=body, headers=front.headers)
    except (aiohttp.ClientConnectionError, TimeoutError) as err:
        return error(502, f"vLLM at {front.upstream} is not answering: {err}")
    async with upstream:
        if upstream.status >= 300:
            return error(upstream.status, upstream_message(await upstream.read()))
        return await relay_stream(request, front, upstream, start)


async def health(request: web.Request) -> web.Response:
    front = front_of(request)
    status, raw, _ = await call_upstream(front, "GET", "/health", timeout=aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_S))
    if status != 200:
        return error(503, f"vLLM at {front.upstream} is not healthy (HTTP {status}): {upstream_message(raw)}")
    return web.json_response(
        {"status": "ok", "index": front.index, "kind": "vllm", "weight_version": front.version, **front.place}
    )


async def start(request: web.Request) -> web.Response:
    front = front_of(request)
    await read_json(request)  # a body, if any, must at least be JSON: nothing is sent for a malformed one
    status, raw, ctype = await call_upstream(front, "POST", "/start_weight_update")
    front.native_session = front.native_session or status < 300
    return relay(status, raw, ctype)


async def finish(request: web.Request) -> web.Response:
    front, body = front_of(request), await read_json(request)
    chosen = parse(FinishRequest, body).chosen
    version = front.version + 1 if chosen is None else chosen
    raw = b""
    if front.native_session:
        status, raw, ctype = await call_upstream(front, "POST", "/finish_weight_update", json=body)
        if status >= 300:
            return relay(status, raw, ctype)
        front.native_session = False
    front.version = version
    if front.on_version is not None:
        front.on_version(version)
    answer = json.loads(raw) if raw else {}
    return web.json_response({**(answer if isinstance(answer, dict) else {}), "weight_version": version})


async def load_adapter(request: web.Request) -> web.Response:
    """A LoRA run's refit: vLLM loads the adapter of `version` under its own name, which new requests get."""
    front, body = front_of(request), await read_json(request)
    if front.adapters is None:
        return error(409, "this engine serves no LoRA run: it was started without [actor.lora]")
    req = parse(AdapterRequest, body)
    name = adapter_name(req.version)
    load = {"lora_name": name, "lora_path": req.path}
    status, raw, _ = await call_upstream(front, "POST", "/v1/load_lora_adapter", json=load)
    if status >= 300:
        return error(status, f"vLLM did not load the adapter at {req.path}: {upstream_message(raw)}")
    retired = front.adapters.switch(name)
    front.version = req.version
    if front.on_version is not None:
        front.on_version(req.version)
    for old in retired:
        await unload_adapter(front, old)
    return web.json_response({"weight_version": req.version, "adapter": name})


async def unload_adapter(front: Front, name: str) -> None:
    """Unload a retired adapter; one that fails to unload stays cached in vLLM, which evicts it in time."""
    status, raw, _ = await call_upstream(front, "POST", "/v1/unload_lora_adapter", json={"lora_name": name})
    if status >= 300:
        get_logger().warning("vLLM did not unload retired adapter %s: %s", name, upstream_message(raw))


async def rpc(request: web.Request) -> web.Response:
    body = await read_json(request)
    method = parse(RpcRequest, body).method
    if not method.startswith(RPC_PREFIX):
        return error(403, f"only the refit extension's {RPC_PREFIX}* methods may be called, not {method!r}")
    return relay(*await call_upstream(front_of(request), "POST", "/collective_rpc", json=body))


async def forward(request: web.Request) -> web.Response:
    """A control route or a `/v1/` route, relayed once its body passed the edge checks (`BODY_MODELS`)."""
    if request.path not in FORWARDED:
        forwardable_path(request, "/v1/")
    raw = await read_body(request)
    decoded = loads(raw)
    model = BODY_MODELS.get(request.path)
    if model is not None:
        parse(model, decoded)
    ctype = request.headers.get("Content-Type") if raw else None
    return relay(*await call_upstream(front_of(request), request.method, request.path_qs, ctype, data=raw))


def build_front(front: Front) -> web.Application:
    """The aiohttp app of one front; its client session opens on startup and closes on cleanup."""
    middlewares = [token_middleware(front.token, front.open_health), errors_middleware]
    app = web.Application(middlewares=middlewares, client_max_size=1 << 30)
    app[FRONT] = front
    app.on_startup.append(open_session)
    app.on_cleanup.append(close_session)
    app.router.add_post(GENERATE_PATH, generate)
    app.router.add_get("/health", health)
    app.router.add_post("/start_weight_update", start)
    app.router.add_post("/finish_weight_update", finish)
    app.router.add_post("/collective_rpc", rpc)
    app.router.add_post("/molt_load_adapter", load_adapter)
    for path in FORWARDED:
        app.router.add_route("*", path, forward)
    app.router.add_route("*", "/v1/{tail:.*}", forward)
    return app
