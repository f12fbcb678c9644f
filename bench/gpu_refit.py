"""Refit benchmarks on GPUs, each against a baseline measured in the same run.

Through CUDA IPC, trainer and engine on GPU 0 (any machine with a GPU), Qwen2 0.5B and 7B shapes, bf16
on the wire (1.26 GB / 15.2 GB):
- trainer: this process, an FSDP2 world of one holding fp32 master weights (random init with
  `from_config`); a refit is `molt_hpc.actor.sync.EngineSync.refit`, end to end: health check, the
  weights out of FSDP, `RefitSender` (start → update → finish). A world of one hands over its own
  parameters, so the engine reads them in place (`refit/shared_params.py`, shared once); for
  comparison the same sender's slot path (buckets packed into slots shared once, copied out);
- engine: a real engine process on the same GPU (`molt_hpc.engine.main.serve` with its bf16 model
  built in memory);
- baseline: a device-to-device copy of the engine's bf16 bytes in one process (4 bytes of memory
  traffic per parameter). Reading fp32 and writing bf16 is 6: 1.5x is the floor of any refit from an
  fp32 master (the flat-cast row measures it); packing and copying out is 10 (2.5x).

Over NCCL (two GPUs), a Qwen2-7B shape, trainer on GPU 0 → engine on GPU 1, next to a raw NCCL
broadcast of the same bytes between the same two processes in the same run:
- trainer and refit as above, the buckets broadcast (256 MiB) instead of shared;
- engine: a real engine process on GPU 1 whose model is built in memory (15 GB of safetensors would
  take longer to write than the benchmark);
- baseline: before it serves, the engine process joins a raw NCCL group with this one
  (`molt_hpc.refit.group.new_group`) and receives the same bucket sizes, and the same bytes in 1 GiB
  messages; each round ends with a 1-element broadcast back from the engine, so it is really received.

In both, the engine's log-probs on a prompt are compared with the trainer's own forward before the
first refit (different random weights) and after the last (the refit's weights), and the new version
is checked in a generate answer. `--dry-run`: tiny shapes on the CPU (/dev/shm slots, gloo).

    python bench/gpu_refit.py [--out rows.jsonl] [--shapes 0.5b 7b] [--dry-run]
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
from gpu_common import build_model, gpu_env, sync, write_row
from refit_floors import ROUNDS, local, one_process_floors

from molt_hpc.config import load_config, to_toml
from molt_hpc.engine.client import generate
from molt_hpc.refit.buckets import TensorMeta, dtype_name, plan_buckets
from molt_hpc.refit.group import connect_store, host_store, new_group
from molt_hpc.rundir import RunDir, create_run_dir

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


def ipc_engine_main(run_dir: Path, shape: str, dry: bool) -> int:
    """The engine process of the IPC refit: build the model, serve as engine 0 on the trainer's GPU."""
    from molt_hpc.engine.main import serve
    from molt_hpc.log import setup_logging

    setup_logging("engine 0")
    run = RunDir(run_dir)
    cfg = load_config(run.config)
    model = build_model(shape, getattr(torch, cfg.model.dtype), "cpu" if dry else "cuda", seed=1)
    asyncio.run(serve(cfg, run, 0, model=model))
    return 0


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
    from molt_hpc.algorithm import token_logprobs

    tokens, logprobs, version = asyncio.run(engine_answer(url, token))
    ids = torch.tensor([PROMPT + tokens], device=device)
    with torch.no_grad():
        mine, _ = token_logprobs(model(input_ids=ids).logits, ids)
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
    from molt_hpc.actor.sync import EngineSync
    from molt_hpc.actor.world import init_world
    from molt_hpc.parallel import parallelize

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


def slot_refits(model, url: str, run: RunDir, version: int, device) -> tuple[list[float], int]:
    """`RefitSender`'s slot path (256 MiB buckets) to the same engine, the first round a warm-up."""
    from molt_hpc.config.infra import RefitConfig
    from molt_hpc.parallel.expert_gather import refit_metas
    from molt_hpc.refit import RefitSender

    sender = RefitSender(run.path, RefitConfig(bucket_mb=256, host="127.0.0.1", backend="ipc"), run.token(), device)
    sender.connect([url])
    metas, times = refit_metas(model, torch.bfloat16), []
    for r in range(ROUNDS):
        version += 1
        named = [(n, local(p)) for n, p in model.named_parameters()]
        stats = sender.push(named, version, metas=metas)
        assert stats.buckets > 0, "the slot path packs buckets"
        if r:
            times.append(stats.seconds)
    sender.close()
    return times, version


def in_place_refits(cfg, run: RunDir, world, model) -> tuple[list[float], int]:
    """`EngineSync.refit` to the engine `ROUNDS` times (the first connects and shares the parameters: a
    warm-up): the seconds of the others, and the last version."""
    from molt_hpc.actor.sync import EngineSync

    times: list[float] = []
    version = 0
    engine_sync = EngineSync(cfg, run.path, world)
    for r in range(ROUNDS):
        version += 1
        dt = engine_sync.refit(model, version)
        assert dt is not None, f"the refit failed (see {run.logs})"
        if r:
            times.append(dt)
    engine_sync.close()
    return times, version


def ipc_refit(out: Path | None, shape: str, dry: bool) -> None:
    """The refit from this process to an engine process on the same GPU, through CUDA IPC (see the top)."""
    from molt_hpc.actor.world import init_world
    from molt_hpc.parallel import parallelize

    dev = "cpu" if dry else "cuda"
    sets = ["model.dtype='bfloat16'", "refit.host='127.0.0.1'", f"actor.device='{dev}'", f"engines.device='{dev}'",
            "engines.max_batch=8", "engines.max_model_len=256", "refit.backend='ipc'"]  # fmt: skip
    cfg = load_config(None, sets)
    run = create_run_dir(tempfile.mkdtemp(prefix="bench-gpu-refit-ipc-"), "run", to_toml(cfg))
    cmd = [sys.executable, __file__, "--ipc-engine", str(run.path), shape] + (["--dry-run"] if dry else [])
    env = gpu_env() if dry else {**gpu_env(), "CUDA_VISIBLE_DEVICES": "0"}
    log = open(run.logs / "engine-0.log", "wb")  # noqa: SIM115 - the child owns it
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, env=env)
    try:
        world = init_world(cfg.actor)
        model = parallelize(build_model(shape, torch.float32, world.device, seed=0), world.mesh, cfg.actor,
                            compute_dtype=torch.bfloat16)  # fmt: skip
        total, base, floor, cast, flat = one_process_floors(model, world.device)
        url = wait_url(run, proc)
        token = run.token()
        before, _ = trainer_diff(model, url, token, world.device)
        times: dict[str, list[float]] = {}
        times["refit end to end, the engine reads the trainer's parameters in place"], version = in_place_refits(
            cfg, run, world, model
        )
        if not dry:  # on the CPU a world of one still refits through /dev/shm slots
            assert "read them in place" in (run.logs / "engine-0.log").read_text(), "the engine mapped the parameters"
        after_in_place, served = trainer_diff(model, url, token, world.device)
        assert served == version, f"the engine serves version {served}, not {version}"
        times["refit, the same sender's slot path (256 MiB buckets)"], version = slot_refits(
            model, url, run, version, world.device
        )
        after, served = trainer_diff(model, url, token, world.device)
        assert served == version, f"the engine serves version {served}, not {version}"
    finally:
        proc.terminate()
        proc.wait()
    name = f"{shape} bf16 ({total / 1e9:.2f} GB), trainer and engine on one GPU"
    write_floor_rows(out, name, total, base, floor, flat, cast)
    write_refit_rows(out, name, total, base, floor, cast, times)
    write_row(out, bench="refit (1 GPU)", case=f"{name}: log-probs engine vs trainer after the in-place refits",
              value=after_in_place, unit="max abs", note=f"before the first refit: {before:.2f}")  # fmt: skip
    write_row(out, bench="refit (1 GPU)", case=f"{name}: log-probs engine vs trainer after the slot refits",
              value=after, unit="max abs", note=f"engine serves v{served}")  # fmt: skip
    del model
    if not dry:
        torch.cuda.empty_cache()


def write_floor_rows(
    out: Path | None, name: str, total: int, base: float, floor: float, flat: float, cast: float
) -> None:
    """The rows of the one-process measurements: the device copy (the baseline) and the three floors."""
    write_row(out, bench="refit (1 GPU)", case=f"{name}: device copy of the same bytes", value=1000 * base, unit="ms",
              note=f"{total / base / 1e9:.0f} GB/s, one process, the baseline")  # fmt: skip
    write_row(out, bench="refit (1 GPU)", case=f"{name}: its two passes in one process (fp32 -> bf16 pack, copy out)",
              value=1000 * floor, unit="ms", baseline=1000 * base, ratio=floor / base,
              note="the floor of a refit that packs and copies each byte; no second process, no protocol")  # fmt: skip
    write_row(out, bench="refit (1 GPU)", case=f"{name}: one fp32 -> bf16 cast of as many contiguous elements",
              value=1000 * flat, unit="ms", baseline=1000 * base, ratio=flat / base,
              note="the memory system's floor of any refit from fp32 master weights (6 bytes moved per 4)")  # fmt: skip
    write_row(out, bench="refit (1 GPU)", case=f"{name}: the engine's fp32 -> bf16 parameter copy, one process",
              value=1000 * cast, unit="ms", baseline=1000 * base, ratio=cast / base,
              note="the floor of the in-place refit; no second process, no protocol")  # fmt: skip


def write_refit_rows(
    out: Path | None, name: str, total: int, base: float, floor: float, cast: float, times: dict[str, list[float]]
) -> None:
    """One row per refit case: its median against the device copy and against its own one-process floor."""
    for case, values in times.items():
        med = statistics.median(values)
        floor_of = cast if "in place" in case else floor
        write_row(out, bench="refit (1 GPU)", case=f"{name}: {case}", value=1000 * med, unit="ms",
                  baseline=1000 * base, ratio=med / base, target="<= 1.5x",
                  note=f"{total / med / 1e9:.0f} GB/s; {med / floor_of:.2f}x its floor in one process")  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU: checks the script")
    ap.add_argument("--shapes", nargs="+", default=["0.5b", "7b"], help="shapes of the CUDA IPC refit")
    ap.add_argument("--no-nccl", action="store_true", help="skip the two-GPU NCCL refit")
    ap.add_argument("--engine", nargs=2, metavar=("RUN_DIR", "PORT"), help=argparse.SUPPRESS)
    ap.add_argument("--ipc-engine", nargs=2, metavar=("RUN_DIR", "SHAPE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.engine:
        return engine_main(Path(args.engine[0]), int(args.engine[1]), "tiny" if args.dry_run else "7b", args.dry_run)
    if args.ipc_engine:
        return ipc_engine_main(Path(args.ipc_engine[0]), args.ipc_engine[1], args.dry_run)
    from molt_hpc.log import setup_logging

    setup_logging("trainer")  # the sender's lines: how long each part of a refit took
    gpus = torch.cuda.device_count()
    if not (args.dry_run or gpus):
        print("gpu_refit: needs a CUDA GPU (two for the NCCL refit); --dry-run on a CPU")
        return 0
    for shape in ["tiny"] if args.dry_run else args.shapes:
        ipc_refit(args.out, shape, args.dry_run)
    if (args.dry_run or gpus >= 2) and not args.no_nccl:
        two_processes(args.out, args.dry_run)
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
