"""The vLLM teacher process (`distill.kind = "vllm"`): `vllm serve` of the teacher behind a front that speaks
the teacher's `POST /logprobs` (`molt_hpc.scorer.teacher`), so the rollout's client does not know which kind
answers.

The front asks vLLM's OpenAI-compatible completions route for the prompt log-probs of every sequence at
once: `POST /v1/completions` with `{"prompt": [[token ids], ...], "max_tokens": 1, "prompt_logprobs": 0,
"temperature": 1}` (the prompt is the whole sequence, completion included: one token is generated and
dropped). vLLM answers `choices[i].prompt_logprobs`, a list as long as prompt i whose first entry is None
(token 0 has no context) and whose entry t is a dict `{"<token id>": {"logprob", "rank", "decoded_token"}}`
holding at least the actual token t (and, with `prompt_logprobs: k`, the k most likely tokens, ranked 1..k).
The front keeps the entries of the requested spans (and a request's `top_k` as `prompt_logprobs`). vLLM's prompt
log-probs are of the raw distribution (temperature 1, whatever the request's temperature), so a request at
another temperature is refused (the config refuses it first: `rollout.temperature = 1`). vLLM listens on
127.0.0.1 with the run's token as its API key; the front checks the token on every route; vLLM dying ends
this process with 1 and the pool restarts it (`molt_hpc.scorer.vllm.serve_vllm`).
"""

import asyncio
import sys
import time
from pathlib import Path
from typing import Any

from molt_hpc.config import MoltConfig
from molt_hpc.log import get_logger, setup_logging
from molt_hpc.rundir import RunDir

SERVED_NAME = "teacher"


def vllm_teacher_command(cfg: MoltConfig, model_dir: str | Path, port: int, index: int) -> list[str]:
    """`vllm serve` of the teacher for teacher `index` on 127.0.0.1:`port` (the token goes in the environment)."""
    dist = cfg.distill
    assert dist is not None
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--served-model-name", SERVED_NAME, "--dtype", dist.dtype]
    # One more than a rollout's longest sequence: the completion's one generated token must fit.
    cmd += ["--max-model-len", str(cfg.engines.max_model_len + 1), "--generation-config", "vllm"]
    cmd += [
        "--gpu-memory-utilization",
        str(dist.gpu_memory_utilization),
        "--seed",
        str(cfg.run.seed * 1000 + 700 + index),
    ]
    return cmd + list(dist.extra_args)


def completion_body(sequences: list[list[int]], top_k: int = 0) -> dict[str, Any]:
    """vLLM's completions request for the prompt log-probs of `sequences`: the actual tokens', and the
    `top_k` most likely tokens' at each position."""
    return {"model": SERVED_NAME, "prompt": sequences, "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": top_k}


def span_values(answer: Any, sequences: list[list[int]], spans: list[list[tuple[int, int]]], top_k: int = 0) -> list:
    """Per sequence `{"logprobs": [...]}`, the log-prob of every token in its spans, read from vLLM's
    completions `answer` (with `top_ids` and `top_logprobs` per scored token, its position's entries of
    rank 1..`top_k`, when `top_k > 0`); a `ValueError` says what in the answer does not fit the request."""
    choices = sorted(answer.get("choices") or [], key=lambda c: c.get("index", 0)) if isinstance(answer, dict) else []
    if len(choices) != len(sequences):
        raise ValueError(f"vLLM answered {len(choices)} choices for {len(sequences)} prompts")
    out = []
    for i, (choice, seq, rs) in enumerate(zip(choices, sequences, spans, strict=True)):
        plp = choice.get("prompt_logprobs")
        if not isinstance(plp, list) or len(plp) != len(seq) or plp[0] is not None:
            got = len(plp) if isinstance(plp, list) else type(plp).__name__
            raise ValueError(f"choice {i}: prompt_logprobs is not a list of {len(seq)} entries led by None ({got})")
        item: dict[str, list] = {"logprobs": [], **({"top_ids": [], "top_logprobs": []} if top_k else {})}
        for t in (t for a, b in rs for t in range(a, b)):
            entries = plp[t] if isinstance(plp[t], dict) else {}
            item["logprobs"].append(_logprob(entries, seq[t], f"choice {i}: prompt_logprobs[{t}]"))
            if top_k:
                ranked = sorted(
                    (e["rank"], int(tok)) for tok, e in entries.items() if e.get("rank", top_k + 1) <= top_k
                )
                if [r for r, _ in ranked] != list(range(1, top_k + 1)):
                    raise ValueError(
                        f"choice {i}: prompt_logprobs[{t}] does not rank its top {top_k} tokens 1..{top_k}"
                    )
                item["top_ids"].append([tok for _, tok in ranked])
                item["top_logprobs"].append([_logprob(entries, tok, f"prompt_logprobs[{t}]") for _, tok in ranked])
        out.append(item)
    return out


def _logprob(entries: dict, token: int, where: str) -> float:
    entry = entries.get(str(token))
    if not isinstance(entry, dict) or not isinstance(entry.get("logprob"), int | float):
        raise ValueError(f"{where} has no log-prob of the actual token {token}")
    return float(entry["logprob"])


def build_teacher_front(front, vocab_size: int, max_len: int):
    """The token-checking front: the teacher's `/logprobs` (from vLLM's prompt log-probs) and `/health`."""
    import aiohttp
    from aiohttp import web

    from molt_hpc.engine.vllm.front import call_upstream, relay, upstream_message
    from molt_hpc.protocol.edge import error, errors_middleware, read_json, token_middleware
    from molt_hpc.scorer.teacher import parse_logprobs

    app = web.Application(middlewares=[token_middleware(front.token), errors_middleware], client_max_size=1 << 28)

    async def open_session(_app) -> None:
        front.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))

    async def close_session(_app) -> None:
        if front.session is not None:
            await front.session.close()

    async def logprobs(request: web.Request) -> web.Response:
        asked = parse_logprobs(await read_json(request), vocab_size, max_len)
        if asked.temperature != 1.0:
            raise ValueError(f"temperature {asked.temperature}: a vLLM teacher scores at temperature 1 only")
        start = time.perf_counter()
        body = completion_body(asked.sequences, asked.top_k)
        status, raw, ctype = await call_upstream(front, "POST", "/v1/completions", json=body)
        seconds = time.perf_counter() - start
        if status != 200:
            return relay(status, raw, ctype)
        import json

        try:
            values = span_values(json.loads(raw), asked.sequences, asked.spans, asked.top_k)
        except (ValueError, json.JSONDecodeError) as err:  # vLLM answered something else: a 502, tried again
            return error(502, f"vLLM at {front.upstream}: {err}")
        data = [{"index": i, **v} for i, v in enumerate(values)]
        tokens = sum(len(v["logprobs"]) for v in values)
        return web.json_response({"object": "list", "model": SERVED_NAME, "data": data, "tokens": tokens,
                                  "seconds": seconds})  # fmt: skip

    async def health(request: web.Request) -> web.Response:
        status, raw, _ = await call_upstream(front, "GET", "/health", timeout=aiohttp.ClientTimeout(total=10.0))
        if status != 200:
            return error(503, f"vLLM at {front.upstream} is not healthy (HTTP {status}): {upstream_message(raw)}")
        return web.json_response({"status": "ok", "index": front.index, "kind": "vllm", "role": "teacher"})

    app.on_startup.append(open_session)
    app.on_cleanup.append(close_session)
    app.add_routes([web.post("/logprobs", logprobs), web.get("/health", health)])
    return app


async def serve(cfg: MoltConfig, run: RunDir, index: int) -> int:
    from transformers import AutoConfig

    from molt_hpc.engine.vllm.main import check_vllm
    from molt_hpc.models.teacher import resolve_teacher
    from molt_hpc.scorer.vllm import serve_vllm

    dist = cfg.distill
    assert dist is not None
    version = check_vllm()  # before anything slow: a missing vLLM fails in seconds
    path = resolve_teacher(cfg.model, dist.teacher, run.models)
    vocab = int(AutoConfig.from_pretrained(path, local_files_only=True).vocab_size)
    get_logger().info("vLLM %s teaches with %s", version, path)
    return await serve_vllm(
        cfg, run, index, "teacher", lambda port: vllm_teacher_command(cfg, path, port, index),
        lambda front: build_teacher_front(front, vocab, cfg.engines.max_model_len),
    )  # fmt: skip


def main(cfg: MoltConfig, run_dir: str | Path, index: int) -> int:
    """Run vLLM teacher `index` of the run in `run_dir` until SIGTERM (0) or vLLM dies (1)."""
    setup_logging(f"teacher {index}", cfg.logging.level)
    return asyncio.run(serve(cfg, RunDir(Path(run_dir)), index))
