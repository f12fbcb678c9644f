"""Stand-in for `vllm serve` of a distillation teacher (`distill.kind = "vllm"`) on a CPU: vLLM's completions
route with prompt log-probs, computed by a real forward of the teacher with transformers.

vLLM needs a GPU, so this real HTTP process answers as `vllm serve --model DIR` does for what the vLLM
teacher's front asks: `POST /v1/completions` with `prompt` a list of token-id lists, `max_tokens`,
`temperature` and `prompt_logprobs: k` answers `{"id", "object": "text_completion", "model", "choices":
[{"index", "text", "logprobs": None, "finish_reason", "prompt_logprobs": [None, {"<id>": {"logprob",
"rank", "decoded_token"}}, ...]}], "usage"}`, each entry holding the actual token and the k most likely
ones, log-probs of the raw distribution (temperature 1) in float32 as vLLM computes them; `/v1` routes
need `VLLM_API_KEY` as a bearer token, `/health` does not. Each sequence is one forward alone (no
padding). It writes `{"pid", "argv"}` to `$VLLM_STANDIN_DIR/standin-<pid>.json`, so a test
can SIGKILL it (a `vllm serve` dying); it is written as the server starts.

`standin_site(dir)` lays out an installed-looking `vllm` 0.26.0 package (metadata pinning this torch)
whose `vllm.entrypoints.openai.api_server` runs this file: on PYTHONPATH, the vLLM teacher starts it.
"""

import importlib.metadata
import json
import os
import sys
import time
from pathlib import Path

API_SERVER = "import runpy, sys\nrunpy.run_path({path!r}, run_name='__main__')\n"


def standin_site(root: Path) -> Path:
    """A `vllm` package on `root` (put `root` on PYTHONPATH) whose API server is this stand-in."""
    pkg = root / "vllm" / "entrypoints" / "openai"
    pkg.mkdir(parents=True, exist_ok=True)
    for d in (root / "vllm", root / "vllm" / "entrypoints", pkg):
        (d / "__init__.py").write_text("")
    (pkg / "api_server.py").write_text(API_SERVER.format(path=str(Path(__file__).resolve())))
    info = root / "vllm-0.26.0.dist-info"
    info.mkdir(exist_ok=True)
    torch_pin = importlib.metadata.version("torch").split("+")[0]
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: 0.26.0\nRequires-Dist: torch=={torch_pin}\n"
    )
    return root


def prompt_logprobs(model, tokenizer, seq: list[int], k: int) -> tuple[list, int]:
    """vLLM's prompt_logprobs of `seq` (None first) and the greedy next token."""
    import torch

    with torch.no_grad():
        logits = model(input_ids=torch.tensor([seq])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    out: list = [None]
    for t in range(1, len(seq)):
        row, actual = logp[t - 1], seq[t]
        entries = {actual: int((row > row[actual]).sum()) + 1}
        if k > 0:
            entries.update(
                {int(i): r + 1 for r, i in enumerate(torch.topk(row, k).indices.tolist()) if int(i) != actual}
            )
        out.append({str(i): {"logprob": float(row[i]), "rank": rank, "decoded_token": tokenizer.decode([i])}
                    for i, rank in entries.items()})  # fmt: skip
    return out, int(logp[-1].argmax())


def build_app(model, tokenizer, served: str, key: str, max_len: int):
    from aiohttp import web

    async def completions(request: web.Request) -> web.Response:
        if request.headers.get("Authorization") != f"Bearer {key}":
            return web.json_response({"error": "Unauthorized"}, status=401)
        body = await request.json()
        prompts, k = body["prompt"], body.get("prompt_logprobs")
        bad = body.get("model") != served or body.get("max_tokens") != 1 or not isinstance(k, int) or k < 0
        if bad or not all(isinstance(p, list) and p and len(p) + 1 <= max_len for p in prompts):
            message = f"the stand-in takes token-id prompts with max_tokens 1 and prompt_logprobs: {body}"
            return web.json_response(
                {"error": {"message": message, "type": "BadRequestError", "code": 400}}, status=400
            )
        choices = []
        for i, seq in enumerate(prompts):
            plp, nxt = prompt_logprobs(model, tokenizer, seq, k)
            choices.append({"index": i, "text": tokenizer.decode([nxt]), "logprobs": None, "finish_reason": "length",
                            "stop_reason": None, "prompt_logprobs": plp})  # fmt: skip
        tokens = sum(len(p) for p in prompts)
        usage = {"prompt_tokens": tokens, "completion_tokens": len(prompts), "total_tokens": tokens + len(prompts)}
        answer = {"id": f"cmpl-standin-{time.monotonic_ns()}", "object": "text_completion",
                  "created": int(time.time()), "model": served, "choices": choices, "usage": usage}  # fmt: skip
        return web.json_response(answer)

    async def health(request: web.Request) -> web.Response:
        return web.Response()

    async def listening(_app) -> None:
        record = Path(os.environ["VLLM_STANDIN_DIR"]) / f"standin-{os.getpid()}.json"
        record.write_text(json.dumps({"pid": os.getpid(), "argv": sys.argv[1:]}))

    app = web.Application(client_max_size=1 << 28)
    app.on_startup.append(listening)
    app.add_routes([web.post("/v1/completions", completions), web.get("/health", health)])
    return app


def main() -> None:
    import torch
    from aiohttp import web
    from transformers import AutoModelForCausalLM, AutoTokenizer

    args = sys.argv[1:]

    def flag(name: str) -> str:
        return args[args.index(name) + 1]

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(flag("--model"), local_files_only=True, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(flag("--model"), local_files_only=True)
    app = build_app(
        model, tokenizer, flag("--served-model-name"), os.environ["VLLM_API_KEY"], int(flag("--max-model-len"))
    )
    web.run_app(app, host=flag("--host"), port=int(flag("--port")), print=None, access_log=None)


if __name__ == "__main__":
    main()
