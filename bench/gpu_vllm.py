"""vLLM next to the built-in engine on two GPUs: tokens/s on the same batch, and refit time into each against a
raw NCCL broadcast of the same bytes, all in one run.

- model: Qwen2-0.5B shape (untied head), random weights written once as bf16 safetensors; both engines load
  it on GPU 1 as engine processes (`jobs/engine.py`): `engines.kind = "vllm"` (`vllm serve` behind our
  front, CUDA graphs) and the built-in engine (slot KV cache, CUDA graphs);
- tokens/s: 64 concurrent requests × 256 new tokens (128-token prompts, temperature 1, `ignore_eos`)
  through each engine's HTTP route, one engine at a time, after a warm-up round;
- refit: the trainer side in this process on GPU 0 (an FSDP2 world of one holding fp32 master weights)
  runs `EngineSync.refit` end to end (health check, full weights out of FSDP in bf16, then
  `VllmRefitSender` into vLLM or `RefitSender` into the built-in engine), 256 MiB buckets;
- baseline: a raw NCCL broadcast of the same bf16 bytes in the same 256 MiB messages from this process
  to a peer process on GPU 1, each round ended by a 1-element broadcast back;
- check: each engine's log-probs against this process's forward of the refitted weights, and the version
  each engine serves.

    python bench/gpu_vllm.py [--out rows.jsonl]
"""

import argparse
import asyncio
import importlib.util
import json
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from gpu_common import build_model, gpu_env, write_row
from gpu_engine import engine_url, http_round, start_engine
from gpu_refit import ROUNDS, raw_plans, raw_rounds, trainer_diff

from molt_hpc.config import load_config, to_toml
from molt_hpc.refit.group import connect_store, host_store, new_group
from molt_hpc.rundir import create_run_dir

N, PROMPT_LEN, NEW = 64, 128, 256


def peer_main(port: int) -> int:
    """The raw baseline's receiver on GPU 1: the same message plan as the trainer, from the same model."""
    torch.cuda.set_device(0)
    model = build_model("0.5b", torch.bfloat16, "meta", seed=0)
    group = new_group("nccl", connect_store("127.0.0.1", port, 600), "raw/", 1, 2, 600)
    plans = raw_plans(model, torch.bfloat16)
    raw_rounds(group, {k: v for k, v in plans.items() if "256" in k}, torch.device("cuda", 0), 1)
    return 0


def engine_run(tmp: Path, name: str, kind: str, model_dir: Path):
    sets = [f"model.path={json.dumps(str(model_dir))}", "model.dtype='bfloat16'", f"engines.kind='{kind}'",
            f"engines.max_batch={N}", "engines.max_model_len=1024", "engines.device='cuda'", "actor.device='cuda'",
            "engines.gpu_memory_utilization=0.5", "refit.host='127.0.0.1'", "refit.bucket_mb=256"]  # fmt: skip
    cfg = load_config(None, sets)
    return cfg, create_run_dir(tmp, name, to_toml(cfg))


def refit_times(cfg, run, model, world) -> list[float]:
    from molt_hpc.actor.sync import EngineSync

    sync = EngineSync(cfg, run.path, world)
    times = []
    for version in range(1, ROUNDS + 1):
        dt = sync.refit(model, version)
        assert dt is not None, f"the refit into {cfg.engines.kind} failed (see the log)"
        if version > 1:
            times.append(dt)
    sync.close()
    return times


def parse_args() -> argparse.Namespace:
    """The command line: where the rows go, and the peer process's own port."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--dry-run", action="store_true", help="vLLM needs GPUs: prints why nothing ran")
    ap.add_argument("--peer", type=int, metavar="PORT", help=argparse.SUPPRESS)
    return ap.parse_args()


def write_model(model_dir: Path) -> list[list[int]]:
    """The random bf16 model saved to `model_dir` (built on GPU 0, then freed), and the batch's prompts."""
    model = build_model("0.5b", torch.bfloat16, "cuda:0", seed=0)
    vocab = model.config.vocab_size
    model.save_pretrained(model_dir, safe_serialization=True)
    del model
    rng = random.Random(0)
    return [[rng.randrange(1, vocab) for _ in range(PROMPT_LEN)] for _ in range(N)]


def raw_baseline(store, trainer, world, peer: subprocess.Popen) -> tuple[list[float], int]:
    """The raw NCCL broadcast rounds to the peer in 256 MiB messages: their seconds, and the bytes of one round."""
    group = new_group("nccl", store, "raw/", 0, 2, 600)
    plans = {k: v for k, v in raw_plans(trainer, torch.bfloat16).items() if "256" in k}
    raw = raw_rounds(group, plans, world.device, 0)["raw broadcast, 256 MiB buckets"]
    del group
    peer.wait(timeout=120)
    total = sum(next(iter(plans.values())))
    return raw, total


def engine_tps(urls: dict[str, str], runs: dict, prompts: list[list[int]]) -> dict[str, list[float]]:
    """Tokens/s of two rounds through each engine's HTTP route, one engine at a time, after a warm-up round."""
    tps = {}
    for kind, run in runs.items():
        asyncio.run(http_round(urls[kind], run.token(), prompts, NEW))  # warm-up
        tps[kind] = [N * NEW / asyncio.run(http_round(urls[kind], run.token(), prompts, NEW))[0] for _ in range(2)]
    return tps


def write_rows(out: Path | None, tps: dict, raw: list[float], total: int, refit: dict, diffs: dict) -> None:
    """The rows: tokens/s of each engine, the raw broadcast, the refit into each engine, the log-prob check."""
    base_tps = statistics.median(tps["builtin"])
    write_row(out, bench="vllm", case=f"built-in engine, {N} x {NEW} new tokens, HTTP (baseline)",
              value=base_tps, unit="tok/s")  # fmt: skip
    write_row(out, bench="vllm", case=f"vLLM 0.26 engine, {N} x {NEW} new tokens, HTTP via our front",
              value=statistics.median(tps["vllm"]), unit="tok/s", baseline=base_tps,
              ratio=statistics.median(tps["vllm"]) / base_tps)  # fmt: skip
    base = statistics.median(raw)
    write_row(out, bench="vllm", case="raw NCCL broadcast, 256 MiB messages (baseline)", value=1000 * base,
              unit="ms", note=f"{total / base / 1e9:.0f} GB/s, {total / 1e9:.2f} GB")  # fmt: skip
    for kind in ("builtin", "vllm"):
        med = statistics.median(refit[kind])
        write_row(out, bench="vllm", case=f"refit into the {kind} engine, end to end", value=1000 * med,
                  unit="ms", baseline=1000 * base, ratio=med / base, note=f"{total / med / 1e9:.1f} GB/s")  # fmt: skip
    for kind, (diff, served) in diffs.items():
        write_row(out, bench="vllm", case=f"log-probs, {kind} engine vs trainer (bf16)", value=diff,
                  unit="max abs", note=f"serves v{served} after {ROUNDS} refits")  # fmt: skip


def main() -> int:
    args = parse_args()
    if args.peer:
        return peer_main(args.peer)
    if args.dry_run or torch.cuda.device_count() < 2 or importlib.util.find_spec("vllm") is None:
        print("gpu_vllm: needs two CUDA GPUs and vLLM (pip install 'molt-hpc[gpu]'); nothing measured")
        return 0
    from molt_hpc.actor.world import init_world
    from molt_hpc.parallel import parallelize

    tmp = Path(tempfile.mkdtemp(prefix="bench-gpu-vllm-"))
    model_dir = tmp / "model"
    prompts = write_model(model_dir)
    env = {**gpu_env(), "CUDA_VISIBLE_DEVICES": "1"}
    cfg_v, run_v = engine_run(tmp, "vllm", "vllm", model_dir)
    cfg_b, run_b = engine_run(tmp, "builtin", "builtin", model_dir)
    procs = [start_engine(run_v, env), start_engine(run_b, env)]
    store = host_store(600)
    peer = subprocess.Popen([sys.executable, __file__, "--peer", str(store.port)], env=env)
    try:
        world = init_world(cfg_v.actor)
        trainer = parallelize(build_model("0.5b", torch.float32, world.device, seed=1), world.mesh, cfg_v.actor,
                              compute_dtype=torch.bfloat16)  # fmt: skip
        raw, total = raw_baseline(store, trainer, world, peer)
        urls = {"builtin": engine_url(run_b, procs[1], 900), "vllm": engine_url(run_v, procs[0], 900)}
        runs = {"builtin": run_b, "vllm": run_v}
        tps = engine_tps(urls, runs, prompts)
        refit = {
            "builtin": refit_times(cfg_b, run_b, trainer, world),
            "vllm": refit_times(cfg_v, run_v, trainer, world),
        }
        diffs = {k: trainer_diff(trainer, urls[k], run.token(), world.device) for k, run in runs.items()}
    finally:
        for proc in [*procs, peer]:
            proc.terminate()
            proc.wait()
    write_rows(args.out, tps, raw, total, refit, diffs)
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
