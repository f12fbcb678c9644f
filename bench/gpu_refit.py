"""Refit of a Qwen2-7B-shape model (bf16 on the wire, 15.2 GB), trainer on GPU 0 → engine on GPU 1, next to a
raw NCCL broadcast of the same bytes between the same two processes in the same run.

- trainer: this process, an FSDP2 world of one on GPU 0 holding fp32 master weights (random init with
  `from_config`); a refit is `molt_hpc.actor.sync.EngineSync.refit`, end to end: health check, the
  full weights out of FSDP in bf16, `RefitSender` (start → packed 256 MiB buckets over NCCL → finish);
- engine: a real engine process on GPU 1 (`molt_hpc.engine.main.serve`: HTTP server, scheduler, the
  weight-transfer routes, `RefitReceiver`) whose bf16 model is built in memory with `from_config`
  instead of read from disk (15 GB of safetensors would take longer to write than the benchmark);
- baseline: before it serves, the engine process joins a raw NCCL group with this one
  (`molt_hpc.refit.group.new_group`) and receives the same bucket sizes, and the same bytes in 1 GiB
  messages; each round ends with a 1-element broadcast back from the engine, so it is really received.

The engine's log-probs on a prompt are compared with the trainer's own forward before the first refit
(different random weights) and after the last (the refit's weights), and the new version is checked
in a generate answer.

With one GPU (no NCCL group can join two processes on one device) it times what surrounds the wire
on that GPU instead: the trainer side (full weights out of FSDP in bf16, packed into the buckets), both
sides without the broadcast (+ the engine's load into its bf16 parameters), against a device copy of
the same bytes; and the protocol's fixed cost as the whole refit of a tiny model on the CPU over gloo.

    python bench/gpu_refit.py [--out rows.jsonl] [--dry-run]
"""

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import torch
from gpu_common import build_model, gpu_env, sync, timed, write_row

from molt_hpc.config import load_config, to_toml
from molt_hpc.engine.client import generate
from molt_hpc.refit.buckets import TensorMeta, dtype_name, plan_buckets
from molt_hpc.refit.group import connect_store, host_store, new_group
from molt_hpc.rundir import RunDir, create_run_dir

ROUNDS = 4  # the first is a warm-up
PROMPT = list(range(1, 17))


def raw_plans(model, wire: torch.dtype) -> dict[str, list[int]]:
    """Message sizes of the baseline: the refit's 256 MiB bucket plan, and 1 GiB messages of the same bytes."""
    metas = [TensorMeta(n, dtype_name(wire), tuple(p.shape)) for n, p in model.named_parameters()]
    total = sum(m.nbytes for m in metas)
    return {
        "raw broadcast, 256 MiB buckets": [b.nbytes for b in plan_buckets(metas, 256 << 20)],
        "raw broadcast, 1 GiB messages": [min(1 << 30, total - s) for s in range(0, total, 1 << 30)],
    }


def raw_rounds(group, plans: dict[str, list[int]], device, rank: int) -> dict[str, list[float]]:
    """Both ends: every plan `ROUNDS` times from rank 0, each ended by a broadcast back from rank 1."""
    size = max(max(p) for p in plans.values())
    bufs = [torch.ones(size, dtype=torch.uint8, device=device) for _ in range(2)]
    done = torch.zeros(1, device=device)
    times: dict[str, list[float]] = {}
    for r in range(ROUNDS):
        for name, plan in plans.items():
            sync(device)
            t0 = time.perf_counter()
            for k, n in enumerate(plan):
                group.broadcast(bufs[k % 2][:n], src=0)
            group.broadcast(done, src=1).wait()
            sync(device)
            if r:
                times.setdefault(name, []).append(time.perf_counter() - t0)
    return times


def engine_main(run_dir: Path, port: int, shape: str, dry: bool) -> int:
    """The engine process: build the model, be the baseline's receiver, then serve as engine 0."""
    from molt_hpc.engine.main import serve
    from molt_hpc.log import setup_logging

    setup_logging("engine 0")
    run = RunDir(run_dir)
    cfg = load_config(run.config)
    device = "cpu" if dry else "cuda"
    dtype = getattr(torch, cfg.model.dtype)
    model = build_model(shape, dtype, device, seed=1)
    store = connect_store("127.0.0.1", port, 600)
    group = new_group("gloo" if dry else "nccl", store, "raw/", 1, 2, 600)
    raw_rounds(group, raw_plans(model, dtype), torch.device(device), 1)
    del group, store
    asyncio.run(serve(cfg, run, 0, model=model))
    return 0


async def engine_answer(url: str, token: str) -> tuple[list[int], list[float], int]:
    sp = {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    async with aiohttp.ClientSession() as s:
        out = await generate(s, url, PROMPT, sp, token=token)
    return out.token_ids, out.logprobs, out.weight_version


def trainer_diff(model, url: str, token: str, device) -> tuple[float, int]:
    """Max |engine log-prob − trainer log-prob| on the engine's greedy tokens, and the engine's version."""
    from molt_hpc.algorithm import logprobs_from_logits

    tokens, logprobs, version = asyncio.run(engine_answer(url, token))
    ids = torch.tensor([PROMPT + tokens], device=device)
    with torch.no_grad():
        mine, _ = logprobs_from_logits(model(input_ids=ids).logits, ids)
    return float((mine[0, len(PROMPT) :].cpu() - torch.tensor(logprobs)).abs().max()), version


def wait_url(run: RunDir, proc: subprocess.Popen, timeout: float = 600) -> str:
    path = run.rendezvous / "engine-0.json"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            return json.loads(path.read_text())["url"]
        if proc.poll() is not None:
            raise SystemExit(f"engine died:\n{(run.logs / 'engine-0.log').read_text()[-3000:]}")
        time.sleep(0.2)
    raise SystemExit("engine did not register")


def two_processes(out: Path | None, dry: bool, prefix: str = "") -> None:
    """The refit from this process (trainer) to an engine process, and the raw broadcasts (see the top)."""
    from molt_hpc.actor.parallelize import parallelize
    from molt_hpc.actor.sync import EngineSync
    from molt_hpc.actor.world import init_world

    shape, dev = ("tiny", "cpu") if dry else ("7b", "cuda")
    sets = ["model.dtype='bfloat16'", "refit.host='127.0.0.1'", f"actor.device='{dev}'", f"engines.device='{dev}'",
            "engines.max_batch=8", "engines.max_model_len=256"]  # fmt: skip
    cfg = load_config(None, sets)
    run = create_run_dir(tempfile.mkdtemp(prefix="bench-gpu-refit-"), "run", to_toml(cfg))
    store = host_store(600)
    cmd = [sys.executable, __file__, "--engine", str(run.path), str(store.port)] + (["--dry-run"] if dry else [])
    env = gpu_env() if dry else {**gpu_env(), "CUDA_VISIBLE_DEVICES": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(run.logs / "engine-0.log", "wb"), env=env)  # noqa: SIM115
    try:
        world = init_world(cfg.actor)
        model = parallelize(build_model(shape, torch.float32, world.device, seed=0), world.mesh, cfg.actor,
                            compute_dtype=torch.bfloat16)  # fmt: skip
        group = new_group("gloo" if dry else "nccl", store, "raw/", 0, 2, 600)
        plans = raw_plans(model, torch.bfloat16)
        times = raw_rounds(group, plans, world.device, 0)
        del group
        url = wait_url(run, proc)
        token = run.token()
        before, _ = trainer_diff(model, url, token, world.device)
        total = sum(plans["raw broadcast, 1 GiB messages"])
        version = 0
        for mb in (256, 1024):
            engine_sync = EngineSync(load_config(None, [*sets, f"refit.bucket_mb={mb}"]), run.path, world)
            for r in range(ROUNDS):
                version += 1
                dt = engine_sync.refit(model, version)
                assert dt is not None, "the refit failed (see the log)"
                if r:
                    times.setdefault(f"refit end to end, {mb} MiB buckets", []).append(dt)
            engine_sync.close()
        after, served = trainer_diff(model, url, token, world.device)
        assert served == version, f"the engine serves version {served}, not {version}"
    finally:
        proc.terminate()
        proc.wait()
    base = statistics.median(times["raw broadcast, 256 MiB buckets"])
    for name, values in times.items():
        med = statistics.median(values)
        write_row(out, bench="refit", case=prefix + name, value=1000 * med, unit="ms", baseline=1000 * base,
                  ratio=med / base, target="<= 1.5x" if name.startswith("refit") else None,
                  note=f"{total / med / 1e9:.0f} GB/s, {total / 1e9:.2f} GB")  # fmt: skip
    write_row(out, bench="refit", case=prefix + "log-probs engine vs trainer, after the refits (bf16)", value=after,
              unit="max abs", note=f"before the first refit: {before:.2f}; engine serves v{served}")  # fmt: skip
    torch.distributed.destroy_process_group()


def one_gpu(out: Path | None, shape: str = "7b", device: str = "cuda") -> None:
    """With one GPU no NCCL group can join two processes: time what surrounds the wire, on that GPU."""
    from molt_hpc.actor.parallelize import parallelize
    from molt_hpc.actor.weights import full_buckets
    from molt_hpc.actor.world import init_world
    from molt_hpc.refit.buckets import pack_into, unpack

    cfg = load_config(None, [f"actor.device='{device}'", "model.dtype='bfloat16'"])
    world = init_world(cfg.actor)
    model = parallelize(build_model(shape, torch.float32, world.device, seed=0), world.mesh, cfg.actor,
                        compute_dtype=torch.bfloat16)  # fmt: skip
    engine_params = build_model(shape, torch.bfloat16, world.device, seed=1).state_dict(keep_vars=True)
    names = [n for n, _ in model.named_parameters()]
    metas = [TensorMeta(n, "bfloat16", tuple(p.shape)) for n, p in model.named_parameters()]
    plan = plan_buckets(metas, cfg.refit.bucket_mb << 20)
    total = sum(m.nbytes for m in metas)
    bufs = [torch.empty(max(b.nbytes for b in plan), dtype=torch.uint8, device=world.device) for _ in range(2)]

    def refit_without_wire(load: bool) -> None:
        """EngineSync's gather + RefitSender's packing (+ RefitReceiver's loading), with no broadcast."""
        gathered = full_buckets(model, [[n] for n in names], keep=True, dtype=torch.bfloat16, device=world.device)
        items = (item for bucket in gathered for item in bucket.items())
        for k, bucket in enumerate(plan):
            flat = pack_into(bufs[k % 2], bucket, [next(items)[1] for _ in bucket.metas])
            if load:
                with torch.no_grad():
                    for name, tensor in unpack(flat, bucket):
                        engine_params[name].copy_(tensor)

    src = torch.ones(total, dtype=torch.uint8, device=world.device)
    dst = torch.empty_like(src)
    cases = {
        "device copy of the same bytes, 256 MiB chunks": lambda: [
            dst[s : s + (256 << 20)].copy_(src[s : s + (256 << 20)]) for s in range(0, total, 256 << 20)
        ],
        "trainer side: FSDP full weights (bf16) + pack into buckets": lambda: refit_without_wire(False),
        "both sides without the wire: + load into the engine's bf16 params": lambda: refit_without_wire(True),
    }
    times = {}
    for name, fn in cases.items():
        runs = [timed(fn, world.device) for _ in range(ROUNDS)]
        times[name] = statistics.median(runs[1:])
    base = times["device copy of the same bytes, 256 MiB chunks"]
    wire = total / (346 * 2**30)  # NCCL GPU0->GPU1 broadcast measured earlier on this kind of machine (notes)
    for name, t in times.items():
        write_row(out, bench="refit (1 GPU)", case=name, value=1000 * t, unit="ms", baseline=1000 * base,
                  ratio=t / base, note=f"{total / t / 1e9:.0f} GB/s of {total / 1e9:.2f} GB; the NCCL broadcast "
                  f"alone: {1000 * wire:.0f} ms at the 346 GiB/s measured earlier (not this run)")  # fmt: skip
    torch.distributed.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--dry-run", action="store_true", help="tiny shape on the CPU over gloo: checks the script")
    ap.add_argument("--protocol", action="store_true", help="the tiny CPU run, reported as the protocol's cost")
    ap.add_argument("--engine", nargs=2, metavar=("RUN_DIR", "PORT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    dry = args.dry_run or args.protocol
    if args.engine:
        return engine_main(Path(args.engine[0]), int(args.engine[1]), "tiny" if dry else "7b", dry)
    gpus = torch.cuda.device_count()
    if dry or gpus >= 2:
        two_processes(args.out, dry, "protocol cost (tiny model, CPU, gloo): " if args.protocol else "")
    elif gpus == 1:
        one_gpu(args.out)
        cmd = [sys.executable, __file__, "--protocol"] + (["--out", str(args.out)] if args.out else [])
        dist_env = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")  # this world's, not its
        env = {k: v for k, v in gpu_env().items() if k not in dist_env}
        subprocess.run(cmd, check=True, env={**env, "CUDA_VISIBLE_DEVICES": ""})
    else:
        print("gpu_refit: needs CUDA GPUs (two for the refit itself); --dry-run on a CPU")
    return 0


if __name__ == "__main__":
    sys.exit(main())
