"""The distillation teacher process (`[distill]`, `kind = "builtin"`): a frozen causal LM behind
`POST /logprobs`, on the CPU or a GPU, registered as `RUN_DIR/rendezvous/teacher-<index>.json`.

A request holds token-id sequences and, per sequence, the [start, end) spans of the tokens to score (a
rollout's action ranges); the answer is the teacher's log-prob of each of those tokens given every token
before it, under `softmax(logits / temperature)` (the rollout's temperature: the engines report the
student's sampled tokens the same way), `{"data": [{"index": i, "logprobs": [...]}], "tokens": n,
"seconds": s}` with `seconds` the time its forwards took; with `top_k > 0` each item also holds, per
scored token, the `top_k` most likely tokens at its position, `top_ids` and `top_logprobs`. `GET /health`
answers `{"status": "ok", ...}`; every route needs the run's token. Sequences run `distill.max_batch` at a
time, right-padded (causal attention keeps real tokens from seeing the padding after them), in a worker
thread so `/health` answers while a batch runs; the log-probs come from the last hidden states and the LM
head chunk by chunk, as the trainer computes the policy's (`molt_hpc.algorithm.logprobs`), only at the
scored positions (the top tokens from the same positions' full log-softmax, 1024 positions at a time).
"""

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

from molt_hpc.config import MoltConfig
from molt_hpc.log import get_logger
from molt_hpc.protocol.edge import parse
from molt_hpc.rundir import RunDir
from molt_hpc.scorer.builtin import listen
from molt_hpc.scorer.builtin import main as run_process
from molt_hpc.scorer.request import LogprobsRequest

Spans = list[list[tuple[int, int]]]


class Asked(NamedTuple):
    """A logprobs request, checked."""

    sequences: list[list[int]]
    spans: Spans
    temperature: float
    top_k: int


def parse_logprobs(body: Any, vocab_size: int, max_len: int) -> Asked:
    """The checked logprobs request; a `ValueError` (→ 400) says what is wrong."""
    req = parse(LogprobsRequest, body, "the body (with 'input': token-id lists, 'ranges': spans per sequence)")
    spans = req.spans()
    for i, s in enumerate(req.input):
        if len(s) > max_len:
            raise ValueError(f"input[{i}] has {len(s)} tokens, over the teacher's {max_len} (engines.max_model_len)")
        if min(s) < 0 or max(s) >= vocab_size:
            raise ValueError(f"input[{i}] has a token id outside the vocabulary (0..{vocab_size - 1})")
    return Asked(req.input, spans, req.temperature, req.top_k)


def span_logprobs(model, asked: Asked, max_batch: int) -> list[dict[str, list]]:
    """Per sequence `{"logprobs": [...]}`, the model's log-prob of every token in its spans (in span order),
    with `top_ids` and `top_logprobs` (per scored token, the `top_k` most likely tokens at its position,
    most likely first) when `asked.top_k > 0`."""
    import torch

    from molt_hpc.actor.batch import head_source
    from molt_hpc.algorithm.logprobs import token_logprobs

    sequences, spans, temperature = asked.sequences, asked.spans, asked.temperature
    device = next(model.parameters()).device
    out: list[dict[str, list]] = []
    with torch.no_grad():
        for lo in range(0, len(sequences), max_batch):
            part, where = sequences[lo : lo + max_batch], spans[lo : lo + max_batch]
            ids = torch.zeros((len(part), max(len(s) for s in part)), dtype=torch.long)
            mask = torch.zeros(ids.shape, dtype=torch.bool)
            for r, (seq, rs) in enumerate(zip(part, where, strict=True)):
                ids[r, : len(seq)] = torch.tensor(seq, dtype=torch.long)
                for a, b in rs:
                    mask[r, a:b] = True
            ids, mask = ids.to(device), mask.to(device)
            source, weight = head_source(model, {"input_ids": ids, "use_cache": False})
            logp, _ = token_logprobs(source, ids, lm_head_weight=weight, mask=mask, temperature=temperature)
            logp = logp.float().cpu()
            for r, rs in enumerate(where):
                item: dict[str, list] = {"logprobs": [x for a, b in rs for x in logp[r, a:b].tolist()]}
                if asked.top_k:
                    rows = torch.tensor([t - 1 for a, b in rs for t in range(a, b)], device=device)
                    item["top_ids"], item["top_logprobs"] = top_tokens(
                        source[r, rows], weight, temperature, asked.top_k
                    )
                out.append(item)
    return out


def top_tokens(rows, weight, temperature: float, k: int) -> tuple[list[list[int]], list[list[float]]]:
    """(ids, log-probs) of the `k` most likely tokens after each of `rows` (hidden states with the LM head
    `weight`, or logits when it is None) under `softmax(logits / temperature)`, in float32, most likely first."""
    import torch

    ids: list[list[int]] = []
    values: list[list[float]] = []
    for lo in range(0, rows.shape[0], 1024):  # the logits of 1024 positions at a time
        chunk = rows[lo : lo + 1024]
        logits = chunk if weight is None else chunk.to(weight.dtype) @ weight.t()
        top = torch.log_softmax(logits.float() / temperature, dim=-1).topk(k, dim=-1)
        ids += top.indices.cpu().tolist()
        values += top.values.cpu().tolist()
    return ids, values


def build_app(model, token: str, index: int, max_batch: int, max_len: int, name: str):
    from aiohttp import web

    from molt_hpc.protocol.edge import errors_middleware, read_json, token_middleware

    app = web.Application(middlewares=[token_middleware(token), errors_middleware], client_max_size=1 << 28)
    worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="teach")  # one forward at a time
    vocab = model.config.vocab_size

    def timed(asked: Asked) -> tuple[list, float]:
        start = time.perf_counter()
        return span_logprobs(model, asked, max_batch), time.perf_counter() - start

    async def logprobs(request: web.Request) -> web.Response:
        asked = parse_logprobs(await read_json(request), vocab, max_len)
        values, seconds = await asyncio.get_running_loop().run_in_executor(worker, timed, asked)
        data = [{"index": i, **v} for i, v in enumerate(values)]
        tokens = sum(len(v["logprobs"]) for v in values)
        return web.json_response({"object": "list", "model": name, "data": data, "tokens": tokens, "seconds": seconds})

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "index": index, "kind": "builtin", "role": "teacher"})

    async def close(_app) -> None:
        worker.shutdown(wait=False, cancel_futures=True)

    app.on_cleanup.append(close)
    app.add_routes([web.post("/logprobs", logprobs), web.get("/health", health)])
    return app


async def serve(cfg: MoltConfig, run: RunDir, index: int) -> None:
    from molt_hpc.engine.main import pick_device
    from molt_hpc.models.load import load_causal_lm
    from molt_hpc.models.teacher import resolve_teacher

    dist = cfg.distill
    assert dist is not None
    path = resolve_teacher(cfg.model, dist.teacher, run.models)
    device = pick_device(dist.device)
    model = load_causal_lm(path, dtype=dist.dtype, device=device, attn=cfg.model.attn_implementation)
    get_logger().info("teaching with %s on %s", path, device)
    app = build_app(model, run.token(), index, dist.max_batch, cfg.engines.max_model_len, dist.teacher)
    await listen(cfg, run, index, app, role="teacher")


def main(cfg: MoltConfig, run_dir: str | Path, index: int) -> int:
    """Run teacher `index` of the run in `run_dir` until SIGTERM."""
    if cfg.distill is None:
        raise ValueError("this run has no [distill]; a teacher needs distill.teacher")
    return run_process(cfg, run_dir, index, role="teacher", serve=serve)
