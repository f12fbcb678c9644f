"""MoE router replay through vLLM 0.26 on one GPU: the trainer's log-prob gap to the engine and its routing
agreement, with the engine's routing replayed against routing live (the baseline), in one table.

- models: `builtin:tiny-moe` (2 layers, 8 experts, top-2, head size 64) and a 2-layer Qwen3-30B-A3B-shaped
  MoE (hidden 2048, 32 heads of 128, 4 KV heads, 128 experts, top-8, expert width 768; 1.2 B parameters)
  over the tiny-char vocabulary, random weights as bf16 safetensors;
- engines: each model served by its own engine process (`jobs/engine.py`, `engines.kind = "vllm"`: `vllm
  serve` behind our front) with `actor.router_replay = true`, so vLLM runs with
  `--enable-return-routed-experts` (eager, a quarter of the GPU each); the second starts while the first is
  measured;
- rollouts: 64 prompts of 24-72 random tokens, 48 new tokens each at temperature 1, through
  `/inference/v1/generate`; `routed_experts` decoded by the engine client and laid on the trajectories
  turn by turn (`agents/routing.py`), checked against vLLM's format ([P + G - 1, layers, top_k], uint8,
  distinct global ids below the expert count);
- trainer: this process as an FSDP2 world of one on the trainer's path (fp32 master weights, bf16
  compute, each router its own fp32 unit), one forward over the batch, one sample per padded row
  (`actor.batch.policy_logprobs`), under `MoeRouting` with replay and without;
- rows per model: the share of samples whose routing lined up; the log-prob gap to the engine's
  log-probs over every action token (max abs, mean abs in the note), live routing first as the baseline;
  the routing agreement (share of (token, MoE layer) pairs whose live top-k set equals vLLM's; with
  replay, later layers' live top-k is computed on the replayed layers' output).

`--dry-run` runs the same on the CPU with the built-in engine standing in for vLLM (bf16 too) and smaller
shapes: a script check, not a measurement.

    python bench/gpu_moe.py [--out rows.jsonl] [--dry-run]
"""

import argparse
import asyncio
import importlib.util
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import numpy as np
import torch
from gpu import table
from gpu_common import gpu_env, write_row
from gpu_engine import engine_url, start_engine

from molt_hpc.config import MoltConfig, load_config, to_toml
from molt_hpc.rundir import create_run_dir

BIG = dict(hidden_size=2048, num_layers=2, num_heads=32, num_kv_heads=4, head_dim=128, num_experts=128, top_k=8,
           moe_intermediate_size=768)  # fmt: skip
"""Two layers of Qwen3-30B-A3B's shape (its vocabulary aside)."""
DRY_BIG = dict(num_layers=2, num_experts=32, top_k=4, moe_intermediate_size=64)
PROMPTS, NEW, DRY_PROMPTS, DRY_NEW = 64, 48, 8, 12
ENGINE_WAIT_S = 240.0


def build(tmp: Path, name: str, shape: dict) -> Path:
    from molt_hpc.models import build_tiny_moe

    spec = MoltConfig().model.tiny_moe.model_copy(update=shape)
    return build_tiny_moe(tmp / name, spec, dtype="bfloat16")


def wait_engine(run, proc, timeout_s: float) -> str:
    """The engine's URL once registered; on a timeout, the end of its logs (vLLM's too) and exit."""
    from molt_hpc.log import log_tail

    try:
        return engine_url(run, proc, timeout_s)
    except SystemExit:
        for log in sorted(run.logs.glob("*.log")):
            print(f"== {log}:\n{log_tail(log, 40)}", flush=True)
        raise


def engine_run(tmp: Path, name: str, model_dir: Path, dry: bool):
    sets = [f"model.path={json.dumps(str(model_dir))}", "model.dtype='bfloat16'", "actor.router_replay=true",
            "engines.max_batch=64", "engines.max_model_len=256"]  # fmt: skip
    if dry:
        sets += ["engines.kind='builtin'", "engines.device='cpu'", "engines.threads=2"]
    else:
        sets += ["engines.kind='vllm'", "engines.device='cuda'", "actor.device='cuda'", "engines.enforce_eager=true",
                 "engines.gpu_memory_utilization=0.25"]  # fmt: skip
    return create_run_dir(tmp, name, to_toml(load_config(None, sets)))


async def rollouts(url: str, token: str, prompts: list[list[int]], new: int) -> list:
    """One trajectory per prompt, its routing assembled as the rollout does it."""
    from molt_hpc.agents.routing import RoutingTrace
    from molt_hpc.engine.client import generate
    from molt_hpc.trajectory import Trajectory

    sp = {"max_tokens": new, "ignore_eos": True, "temperature": 1.0, "top_k": 0, "routed_experts_prompt_start": 0}
    async with aiohttp.ClientSession() as s:
        outs = await asyncio.gather(
            *[generate(s, url, p, {**sp, "seed": i}, token=token) for i, p in enumerate(prompts)]
        )
    trajs = []
    for p, out in zip(prompts, outs, strict=True):
        routing = RoutingTrace()
        routing.add(out.routed_experts, len(p), len(out.token_ids))
        tokens = p + out.token_ids
        trajs.append(Trajectory(tokens=tokens, prompt_len=len(p), action_ranges=[(len(p), len(tokens))],
                                action_logprobs=out.logprobs, versions=out.weight_versions,
                                routed_experts=routing.rows(len(tokens))))  # fmt: skip
    return trajs, outs


def format_ok(outs, prompts, experts: int, top_k: int, layers: int) -> float:
    """Share of answers whose routed_experts are vLLM's format for this model."""
    good = 0
    for p, out in zip(prompts, outs, strict=True):
        r = out.routed_experts
        good += bool(
            r is not None and r.shape == (len(p) + len(out.token_ids) - 1, layers, top_k) and r.dtype == np.uint8
            and int(r.max()) < experts and all(len(set(row)) == top_k for row in r.reshape(-1, top_k).tolist())
        )  # fmt: skip
    return good / len(outs)


def trainer_pass(model, exp, replay: bool) -> dict[str, float]:
    """Log-prob gap to the engine and routing agreement of one no-grad forward (the trainer's functions)."""
    from molt_hpc.actor.batch import policy_logprobs
    from molt_hpc.actor.moe_router import MoeRouting

    moe = MoeRouting(model, replay=replay, aux_coef=0.0, z_coef=0.0)
    with torch.no_grad(), moe.micro_batch(exp):
        logp, _ = policy_logprobs(model, exp, 1.0, 1024)
        moe.aux_loss(1.0)
    mask = exp.action_mask
    gap = (logp[mask].float() - exp.action_log_probs[mask]).abs()
    metrics = moe.step_metrics(exp)
    return {"max": float(gap.max()), "mean": float(gap.mean()), "agreement": metrics["routing_agreement"]}


def measure(name: str, model_dir: Path, run, url: str, world, prompts, new: int, out: Path | None) -> None:
    from molt_hpc.actor.build import load_model
    from molt_hpc.algorithm import make_experience
    from molt_hpc.config import load_config

    t0 = time.perf_counter()
    trajs, outs = asyncio.run(rollouts(url, run.token(), prompts, new))
    # the trainer's own load: meta-device build, fp32 routers as their own FSDP units, fp32 master weights
    model = load_model(model_dir, load_config(run.path / "config.toml"), world, "policy")
    c = model.config
    lined = format_ok(outs, prompts, c.num_experts, c.num_experts_per_tok, c.num_hidden_layers)
    exp = make_experience(trajs, max_len=512).to(world.device)
    live, replayed = trainer_pass(model, exp, replay=False), trainer_pass(model, exp, replay=True)
    name = f"{name} ({c.num_hidden_layers} layers, {c.num_experts} experts, top-{c.num_experts_per_tok})"
    tokens = int(exp.action_mask.sum())
    took = time.perf_counter() - t0
    write_row(out, bench="moe", case=f"{name}: samples whose routed_experts line up", value=100 * lined, unit="%",
              note=f"{len(prompts)} x {new} tokens, uint8 [P+G-1, layers, top_k]; {took:.0f} s")  # fmt: skip
    write_row(out, bench="moe", case=f"{name}: log-prob gap, live routing (baseline)", value=live["max"],
              unit="max abs", note=f"mean abs {live['mean']:.2e} over {tokens} action tokens")  # fmt: skip
    write_row(out, bench="moe", case=f"{name}: log-prob gap, replayed routing", value=replayed["max"],
              unit="max abs", baseline=live["max"], ratio=replayed["max"] / max(live["max"], 1e-12),
              note=f"mean abs {replayed['mean']:.2e} (live {live['mean']:.2e})")  # fmt: skip
    write_row(out, bench="moe", case=f"{name}: routing agreement, live routing", value=100 * live["agreement"],
              unit="%", note="(token, MoE layer) pairs whose live top-k equals the engine's")  # fmt: skip
    write_row(out, bench="moe", case=f"{name}: routing agreement, replayed routing",
              value=100 * replayed["agreement"], unit="%", note="live top-k on replayed layers' output")  # fmt: skip
    del model
    if world.device.type == "cuda":
        torch.cuda.empty_cache()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--dry-run", action="store_true", help="the CPU with the built-in engine instead of vLLM")
    args = ap.parse_args()
    dry = args.dry_run
    if not dry and (not torch.cuda.is_available() or importlib.util.find_spec("vllm") is None):
        print(
            "gpu_moe: needs a CUDA GPU and vLLM (pip install 'molt-hpc[gpu]'); nothing measured (--dry-run checks it)"
        )
        return 0
    from molt_hpc.actor.world import init_world
    from molt_hpc.config.train import ActorConfig

    t0 = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="bench-gpu-moe-"))
    rng = random.Random(0)
    n, new = (DRY_PROMPTS, DRY_NEW) if dry else (PROMPTS, NEW)
    prompts = [[rng.randrange(4, 104) for _ in range(rng.randrange(24, 73))] for _ in range(n)]
    env = {**gpu_env(), "OMP_NUM_THREADS": "2"} if dry else gpu_env()
    out = args.out or tmp / "rows.jsonl"
    world = init_world(ActorConfig(device="cpu" if dry else "cuda"))
    shapes = {"tiny-moe": {}, "many-expert MoE, dry run" if dry else "Qwen3-30B-A3B shape": DRY_BIG if dry else BIG}
    models, runs, procs = {}, {}, {}
    try:
        # Each engine loads while the next model is built, and the next engine while this one is measured.
        for i, (name, shape) in enumerate(shapes.items()):
            models[name] = build(tmp, f"model-{i}", shape)
            runs[name] = engine_run(tmp, f"engine-{i}", models[name], dry)
            if i == 0:
                procs[name] = start_engine(runs[name], env)
        names = list(shapes)
        for i, name in enumerate(names):
            url = wait_engine(runs[name], procs[name], ENGINE_WAIT_S)
            print(f"== {name}: engine up after {time.perf_counter() - t0:.0f} s", flush=True)
            if i + 1 < len(names):
                procs[names[i + 1]] = start_engine(runs[names[i + 1]], env)
            measure(name, models[name], runs[name], url, world, prompts, new, out)
    finally:
        for proc in procs.values():
            proc.terminate()
            proc.wait()
    torch.distributed.destroy_process_group()
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    print(table([r for r in rows if r["bench"] == "moe"]))
    print(f"== gpu_moe: {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
