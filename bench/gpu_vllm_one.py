"""vLLM on one GPU, no trainer: the same batch straight into vLLM, through our front, and through our engine.

Qwen2-0.5B shape (untied head), random bf16 weights written once; 64 prompts of 128 tokens, 256 new
tokens each (temperature 1, `ignore_eos`), one round after a warm-up round, rows in tokens/s:

- `vllm serve` started with our flags (`molt_hpc.engine.vllm.main.vllm_command`), raw HTTP to its
  `/inference/v1/generate` (aiohttp, one session, 64 concurrent): with and without log-probs, and at 256
  concurrent requests (4 x the batch: what `max_num_seqs` and chunked prefill decide);
- the same server through our front (`engine/vllm/front.py`, its own process, as `engines.kind = "vllm"` runs it):
  the front's hop, against raw HTTP at the same concurrency (target: <= 5% slower);
- with `--sweep`, the server again per flag set of `SWEEP` (each start costs ~1 min): max_num_seqs,
  max_num_batched_tokens, async scheduling, prefix caching;
- our builtin engine (`jobs/engine.py`, started first, idle while vLLM is measured) on the same batch;
- with `--offline-too`, `vllm.LLM` offline in a child process, with the sampled token's log-prob
  (`logprobs=0`) and without (two more starts, ~1.5 min each).

Without the options it runs in about two minutes (one vLLM start).

    python bench/gpu_vllm_one.py [--out rows.jsonl] [--sweep] [--dry-run]
"""

import argparse
import asyncio
import importlib.util
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from gpu_common import gpu_env, write_row

N, PROMPT_LEN, NEW = 64, 128, 256
SWEEP = {
    "max_num_seqs 256": ["--max-num-seqs", "256"],
    "max_num_batched_tokens 16384": ["--max-num-batched-tokens", "16384"],
    "async scheduling": ["--async-scheduling"],
    "no prefix caching": ["--no-enable-prefix-caching"],
}


def offline(model_dir: str, prompts_file: str, logprobs: bool) -> float:
    """Child process: tokens/s of `vllm.LLM.generate` over the batch (second of two calls)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=p) for p in json.loads(Path(prompts_file).read_text())]
    llm = LLM(model_dir, skip_tokenizer_init=True, gpu_memory_utilization=0.5, max_model_len=1024,
              max_num_seqs=N, seed=0, generation_config="vllm")  # fmt: skip
    sp = SamplingParams(max_tokens=NEW, ignore_eos=True, temperature=1.0, logprobs=0 if logprobs else None,
                        detokenize=False)  # fmt: skip
    llm.generate(prompts, sp, use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    dt = time.perf_counter() - t0
    assert all(len(o.outputs[0].token_ids) == NEW for o in outs)
    return len(prompts) * NEW / dt


async def http_round(url: str, token: str, prompts: list[list[int]], sp: dict, session: aiohttp.ClientSession):
    body = lambda p: {"token_ids": p, "sampling_params": sp}  # noqa: E731
    headers = {"Authorization": f"Bearer {token}"}

    async def one(p):
        async with session.post(url + "/inference/v1/generate", json=body(p), headers=headers) as resp:
            assert resp.status == 200, await resp.text()
            data = json.loads(await resp.read())
            assert len(data["choices"][0]["token_ids"]) == sp["max_tokens"]

    t0 = time.perf_counter()
    await asyncio.gather(*[one(p) for p in prompts])
    return len(prompts) * sp["max_tokens"] / (time.perf_counter() - t0)


def measure(url: str, token: str, prompts: list[list[int]], logprobs: bool) -> float:
    sp = {"max_tokens": NEW, "ignore_eos": True, "temperature": 1.0, "top_k": -1, "detokenize": False}
    if logprobs:
        sp["logprobs"] = 0

    async def run():
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            await http_round(url, token, prompts[:N], sp, s)  # warm-up
            return await http_round(url, token, prompts, sp, s)

    return asyncio.run(run())


def wait_http(url: str, proc: subprocess.Popen, log: Path, timeout: float = 400) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:  # not up yet
            pass
        time.sleep(1.0)
    raise SystemExit(f"{url} did not come up:\n{log.read_text()[-3000:]}")


def serve(cfg, model_dir: Path, extra: list[str], tmp: Path, token: str) -> tuple[subprocess.Popen, str, Path]:
    from molt_hpc.engine.vllm.main import vllm_command, vllm_env
    from molt_hpc.net import free_port

    port = free_port("127.0.0.1")
    cmd = vllm_command(cfg, model_dir, port, 0) + extra
    log = tmp / f"vllm-{port}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=vllm_env(token), start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    wait_http(url, proc, log)
    return proc, url, log


def front_main(upstream: str, port: int, token: str) -> int:
    from aiohttp import web

    from molt_hpc.engine.vllm.front import Front, build_front

    web.run_app(build_front(Front(upstream, token, 0)), host="127.0.0.1", port=port, access_log=None,
                print=None)  # fmt: skip
    return 0


def stop(proc: subprocess.Popen) -> None:
    import signal

    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def parse_args() -> argparse.Namespace:
    """The command line: where the rows go, the optional cases, and the child processes' own arguments."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--sweep", action="store_true", help="restart vLLM per flag set of SWEEP (~1 min each)")
    ap.add_argument("--offline-too", action="store_true", help="also vllm.LLM offline, two more starts")
    ap.add_argument("--dry-run", action="store_true", help="vLLM needs a GPU: prints why nothing ran")
    ap.add_argument("--offline", nargs=3, metavar=("MODEL", "PROMPTS", "LOGPROBS"), help=argparse.SUPPRESS)
    ap.add_argument("--front", nargs=3, metavar=("UPSTREAM", "PORT", "TOKEN"), help=argparse.SUPPRESS)
    return ap.parse_args()


def write_model(model_dir: Path) -> list[list[int]]:
    """The random bf16 model saved to `model_dir` (built on GPU 0, then freed), and 4 x the batch of prompts."""
    import torch
    from gpu_common import build_model

    model = build_model("0.5b", torch.bfloat16, "cuda:0", seed=0)
    model.save_pretrained(model_dir, safe_serialization=True)
    vocab = model.config.vocab_size
    del model
    torch.cuda.empty_cache()
    rng = random.Random(0)
    return [[rng.randrange(1, vocab) for _ in range(PROMPT_LEN)] for _ in range(4 * N)]


def first_server_rows(
    cfg, sets: list[str], model_dir: Path, tmp: Path, prompts: list[list[int]], env: dict, token: str, many: str
) -> dict[str, float]:
    """The rows of the first vLLM server (raw HTTP and through our front) and of our builtin engine."""
    from gpu_engine import engine_url, start_engine

    from molt_hpc.config import load_config, to_toml
    from molt_hpc.net import free_port
    from molt_hpc.rundir import create_run_dir

    # the builtin engine first: its memory is taken before vLLM profiles what is free
    run = create_run_dir(tmp, "builtin", to_toml(load_config(None, [*sets[:2], *sets[3:]])))
    eng = start_engine(run, gpu_env())
    b_url = engine_url(run, eng, 300)
    rows: dict[str, float] = {}
    proc, url, _ = serve(cfg, model_dir, [], tmp, token)
    front_port = free_port("127.0.0.1")
    front = subprocess.Popen([sys.executable, __file__, "--front", url, str(front_port), token], env=env,
                             start_new_session=True)  # fmt: skip
    front_url = f"http://127.0.0.1:{front_port}"
    try:
        _wait_front(front_url, token)
        rows[f"vllm serve, raw HTTP, logprobs 0, {N} concurrent"] = measure(url, token, prompts[:N], True)
        rows[f"vllm serve, raw HTTP, logprobs off, {N} concurrent"] = measure(url, token, prompts[:N], False)
        rows[f"vllm serve via our front, logprobs 0, {N} concurrent"] = measure(front_url, token, prompts[:N], True)
        rows[f"vllm serve, raw HTTP, logprobs 0, {many}"] = measure(url, token, prompts, True)
        rows[f"vllm serve via our front, logprobs 0, {many}"] = measure(front_url, token, prompts, True)
        rows[f"vllm serve, raw HTTP, logprobs 0, {N} concurrent, again"] = measure(url, token, prompts[:N], True)
        rows[f"builtin engine, HTTP, {N} concurrent"] = measure(b_url, run.token(), prompts[:N], True)
    finally:
        stop(front)
        stop(proc)
        eng.terminate()
        eng.wait()
    return rows


def sweep_rows(cfg, model_dir: Path, tmp: Path, prompts: list[list[int]], token: str, many: str) -> dict[str, float]:
    """One row per flag set of `SWEEP`, each on a server of its own."""
    rows: dict[str, float] = {}
    for name, extra in SWEEP.items():
        proc, url, _ = serve(cfg, model_dir, extra, tmp, token)
        try:
            rows[f"vllm serve +{name}, raw HTTP, logprobs 0, {many}"] = measure(url, token, prompts, True)
        finally:
            stop(proc)
    return rows


def offline_rows(model_dir: Path, tmp: Path, prompts: list[list[int]], env: dict) -> dict[str, float]:
    """`vllm.LLM` offline in a child process, with the sampled token's log-prob and without."""
    rows: dict[str, float] = {}
    (tmp / "prompts.json").write_text(json.dumps(prompts[:N]))
    for lp in (True, False):
        cmd = [sys.executable, __file__, "--offline", str(model_dir), str(tmp / "prompts.json"), str(int(lp))]
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
        if out.returncode:
            raise SystemExit(f"vllm.LLM failed:\n{out.stderr[-3000:]}")
        tps = json.loads(out.stdout.strip().splitlines()[-1])["tps"]
        rows[f"vllm.LLM offline, logprobs {'0' if lp else 'off'}, {N} prompts"] = tps
    return rows


def write_rows(out: Path | None, rows: dict[str, float], many: str) -> None:
    """Each row against raw HTTP into the same server at the same concurrency."""
    base = rows[f"vllm serve, raw HTTP, logprobs 0, {N} concurrent"]
    base_many = rows[f"vllm serve, raw HTTP, logprobs 0, {many}"]
    for name, tps in rows.items():
        ref = base_many if many in name else base
        write_row(out, bench="vllm1", case=f"{name}, {NEW} new tokens each", value=tps, unit="tok/s",
                  baseline=ref, ratio=tps / ref, target=">= 0.95x" if "front" in name else None,
                  note="baseline: raw HTTP into the same server, logprobs 0, same concurrency")  # fmt: skip


def main() -> int:
    args = parse_args()
    if args.offline:
        print(json.dumps({"tps": offline(args.offline[0], args.offline[1], args.offline[2] == "1")}))
        return 0
    if args.front:
        return front_main(args.front[0], int(args.front[1]), args.front[2])
    import torch

    if args.dry_run or not torch.cuda.is_available() or importlib.util.find_spec("vllm") is None:
        print("gpu_vllm_one: needs a CUDA GPU and vLLM (pip install 'molt-hpc[gpu]'); nothing measured")
        return 0
    from molt_hpc.config import load_config

    tmp = Path(tempfile.mkdtemp(prefix="bench-vllm-one-"))
    model_dir = tmp / "model"
    prompts = write_model(model_dir)
    env = {**gpu_env(), "VLLM_USE_FLASHINFER_SAMPLER": "0"}
    sets = [f"model.path={json.dumps(str(model_dir))}", "model.dtype='bfloat16'", "engines.kind='vllm'",
            f"engines.max_batch={N}", "engines.max_model_len=1024", "engines.device='cuda'",
            "engines.gpu_memory_utilization=0.5"]  # fmt: skip
    cfg = load_config(None, sets)
    token = "bench-token"
    many = f"{4 * N} concurrent"
    rows = first_server_rows(cfg, sets, model_dir, tmp, prompts, env, token, many)
    if args.sweep:
        rows.update(sweep_rows(cfg, model_dir, tmp, prompts, token, many))
    if args.offline_too:
        rows.update(offline_rows(model_dir, tmp, prompts, env))
    write_rows(args.out, rows, many)
    return 0


def _wait_front(url: str, token: str, timeout: float = 60) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    req = urllib.request.Request(url + "/health", headers={"Authorization": f"Bearer {token}"})
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(req, timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:  # not listening yet
            time.sleep(0.5)
    raise SystemExit("the front did not come up")


if __name__ == "__main__":
    sys.exit(main())
