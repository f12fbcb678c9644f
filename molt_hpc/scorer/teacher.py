"""The distillation teacher process (`[distill]`, `kind = "builtin"`): a frozen causal LM behind
`POST /logprobs`, on the CPU or a GPU, registered as `RUN_DIR/rendezvous/teacher-<index>.json`.

A request holds token-id sequences and, per sequence, the [start, end) spans of the tokens to score (a
rollout's action ranges); the answer is the teacher's log-prob of each of those tokens given every token
before it, under `softmax(logits / temperature)` (the rollout's temperature: the engines report the
student's sampled tokens the same way), `{"data": [{"index": i, "logprobs": [...]}], "tokens": n,
"seconds": s}` with `seconds` the time its forwards took. `GET /health` answers `{"status": "ok", ...}`;
every route needs the run's token. Sequences run `distill.max_batch` at a time, right-padded (causal
attention keeps real tokens from seeing the padding after them), in a worker thread so `/health` answers
while a batch runs; the log-probs come from the last hidden states and the LM head chunk by chunk, as the
trainer computes the policy's (`molt_hpc.algorithm.logprobs`), only at the scored positions.
"""

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from molt_hpc.config import MoltConfig
from molt_hpc.log import get_logger
from molt_hpc.protocol.edge import parse
from molt_hpc.rundir import RunDir
from molt_hpc.scorer.builtin import listen
from molt_hpc.scorer.builtin import main as run_process
from molt_hpc.scorer.request import LogprobsRequest

Spans = list[list[tuple[int, int]]]


def parse_logprobs(body: Any, vocab_size: int, max_len: int) -> tuple[list[list[int]], Spans, float]:
    """(sequences, spans, temperature) of a logprobs request; a `ValueError` (→ 400) says what is wrong."""
    req = parse(LogprobsRequest, body, "the body (with 'input': token-id lists, 'ranges': spans per sequence)")
    spans = req.spans()
    for i, s in enumerate(req.input):
        if len(s) > max_len:
            raise ValueError(f"input[{i}] has {len(s)} tokens, over the teacher's {max_len} (engines.max_model_len)")
        if min(s) < 0 or max(s) >= vocab_size:
            raise ValueError(f"input[{i}] has a token id outside the vocabulary (0..{vocab_size - 1})")
    return req.input, spans, req.temperature


def span_logprobs(model, sequences: list[list[int]], spans: Spans, temperature: float, max_batch: int) -> list:
    """The model's log-prob of every token in `spans` of each sequence (a list per sequence, in span order)."""
    import torch

    from molt_hpc.actor.batch import head_source
    from molt_hpc.algorithm.logprobs import token_logprobs

    device = next(model.parameters()).device
    out: list[list[float]] = []
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
            out += [[x for a, b in rs for x in logp[r, a:b].tolist()] for r, rs in enumerate(where)]
    return out


def build_app(model, token: str, index: int, max_batch: int, max_len: int, name: str):
    from aiohttp import web

    from molt_hpc.protocol.edge import errors_middleware, read_json, token_middleware

    app = web.Application(middlewares=[token_middleware(token), errors_middleware], client_max_size=1 << 28)
    worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="teach")  # one forward at a time
    vocab = model.config.vocab_size

    def timed(seqs: list[list[int]], spans: Spans, temperature: float) -> tuple[list, float]:
        start = time.perf_counter()
        return span_logprobs(model, seqs, spans, temperature, max_batch), time.perf_counter() - start

    async def logprobs(request: web.Request) -> web.Response:
        seqs, spans, temperature = parse_logprobs(await read_json(request), vocab, max_len)
        values, seconds = await asyncio.get_running_loop().run_in_executor(worker, timed, seqs, spans, temperature)
        data = [{"index": i, "logprobs": v} for i, v in enumerate(values)]
        tokens = sum(len(v) for v in values)
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
