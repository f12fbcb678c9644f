"""Stand-in for `vllm serve` in the vLLM front's tests: vLLM's HTTP answers over a real builtin engine.

vLLM needs a GPU, so a builtin engine (a real process on the tiny model) stands in for it; this process
puts vLLM's streamed format on it. Every route is relayed to the builtin engine as it is, except a
streamed generate: vLLM's `/inference/v1/generate` with `stream: true` answers server-sent
`data: {...}` chunks of `{"request_id", "choices": [{"index": 0, "token_ids", "logprobs": {"content":
[{"token": "token_id:N", "logprob", "top_logprobs"}]}, "finish_reason", "routed_experts"}]}`, the
finish reason (and the routing) on the last chunk with tokens, a chunk without tokens never sent, then
`data: [DONE]`; an error mid-stream is a `{"error": {"message", "type", "code"}}` chunk before `[DONE]`
(vLLM's `serve_tokens_stream_generator`). The chunks are made from the builtin engine's per-step
events. Killing this process (SIGKILL) is a `vllm serve` dying mid-answer.

Run: `python tests/vllm_standin.py UPSTREAM_URL PORT`.
"""

import json
import sys

import aiohttp
from aiohttp import web

from molt_hpc.engine.stream import events

UPSTREAM = sys.argv[1] if __name__ == "__main__" else ""
SESSION = web.AppKey("session", aiohttp.ClientSession)


def chunk(rid: str, delta: dict, finish: str | None = None, routed: str | None = None) -> bytes:
    content = [
        {"token": f"token_id:{t}", "logprob": lp, "top_logprobs": [{"token": f"token_id:{t}", "logprob": lp}]}
        for t, lp in zip(delta["token_ids"], delta["logprobs"], strict=True)
    ]
    choice = {"index": 0, "logprobs": {"content": content}, "finish_reason": finish, "token_ids": delta["token_ids"]}
    if routed is not None:
        choice["routed_experts"] = routed
    return b"data: " + json.dumps({"request_id": rid, "choices": [choice]}).encode() + b"\n\n"


async def streamed(request: web.Request, body: dict) -> web.StreamResponse:
    """vLLM's chunks of the builtin engine's streamed answer; each is held until the next event says
    whether it is the last (vLLM puts the finish reason on the last chunk with tokens)."""
    headers = {"Authorization": request.headers.get("Authorization", "")}
    async with request.app[SESSION].post(UPSTREAM + request.path, json=body, headers=headers) as up:
        if up.status >= 300:
            return web.Response(status=up.status, body=await up.read(), content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        rid, held, sent = body.get("request_id") or "generate-tokens-standin", None, 0
        async for event in events(up.content):
            if "error" in event:
                problem = {"error": {"message": str(event["error"]), "type": "InternalServerError", "code": 500}}
                await resp.write(b"data: " + json.dumps(problem).encode() + b"\n\n")
                break
            if "choices" in event:  # the whole answer: its tokens past the events are the last chunk's
                answer = event["choices"][0]
                rest = {"token_ids": answer["token_ids"][sent:],
                        "logprobs": [e["logprob"] for e in answer["logprobs"]["content"][sent:]]}  # fmt: skip
                if held is not None and rest["token_ids"]:
                    await resp.write(chunk(rid, held))
                last = rest if rest["token_ids"] else held
                if last is not None:
                    await resp.write(chunk(rid, last, answer["finish_reason"], answer.get("routed_experts")))
                break
            if held is not None:
                await resp.write(chunk(rid, held))
            held, sent = event, sent + len(event["token_ids"])
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


async def relay(request: web.Request) -> web.StreamResponse:
    raw = await request.read()
    if request.path == "/inference/v1/generate" and raw:
        body = json.loads(raw)
        if isinstance(body, dict) and body.get("stream"):
            return await streamed(request, body)
    headers = {k: v for k, v in request.headers.items() if k in ("Authorization", "Content-Type")}
    async with request.app[SESSION].request(
        request.method, UPSTREAM + request.path_qs, data=raw, headers=headers
    ) as up:
        ctype = up.headers.get("Content-Type", "application/json")
        return web.Response(status=up.status, body=await up.read(), headers={"Content-Type": ctype})


async def open_session(app: web.Application) -> None:
    app[SESSION] = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))


async def close_session(app: web.Application) -> None:
    await app[SESSION].close()


def main() -> None:
    app = web.Application(client_max_size=1 << 30)
    app.on_startup.append(open_session)
    app.on_cleanup.append(close_session)
    app.router.add_route("*", "/{tail:.*}", relay)
    web.run_app(app, host="127.0.0.1", port=int(sys.argv[2]), print=None, access_log=None)


if __name__ == "__main__":
    main()
