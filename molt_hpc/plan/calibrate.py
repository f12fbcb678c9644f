"""`molt-hpc plan --calibrate`: measure this machine's speed profile (`[plan.cuda]` or `[plan.cpu]`).

Five small measurements on the device (the fifth on a GPU only) (a GPU when there is one, else the CPU):

- a copy of a large tensor: `memory_gb_per_s` (bytes read plus written per second);
- a square matmul in the model dtype: `matmul_tflops`;
- rounds of the built-in engine's own scheduler on the configured model (random weights, the engine's
  runner: the slot cache and CUDA graphs on a GPU), every row decoding at once: a step's time less its
  memory time at the measured bandwidth, at a few rows and at a full batch, is a fixed part
  (`builtin_step_ms`: launches, the graph replay's host side) and a part per row (`builtin_row_ms`: each
  row's token read back, appended and checked for its stop); a prefill of one short row, over the
  layers, is `builtin_prefill_layer_ms`;
- the trainer's own steps of the same model (`calibrate_train.py`): two of short rows are host time
  (`train_micro_batch_ms`, `train_sample_ms`), one of full rows adds its FLOPs at the achieved rate, over
  `matmul_tflops` the MFU of the model's shape class;
- on a GPU, the engine's decode steps at a full batch alone and while a second process trains the config's step
  on the same GPU (`calibrate_shared.py`): `shared_decode_rate`, and that process's step beside the decoding
  over alone, `shared_train_slowdown`, printed commented out (`SHARED`). Not on a CPU: there a run's engine,
  trainer, rollout and router processes share the cores, and the pair alone (a core each on a 2-core machine)
  found no slowdown while the run's trainer took 1.4-1.7x its calibrated step; priced with the pair's numbers
  the tiny config's step came out 1.56-1.80x short, in sequence 1.20-1.40x (`docs/scale.md`).

The model is built from its config alone, so calibrate with a config whose model fits one device (the
SmolLM2 recipe, or the 0.5B shape on a GPU; the tiny configs on a CPU): seconds on a CPU.
"""

from molt_hpc.config import MoltConfig
from molt_hpc.plan.calibrate_shared import measure_shared
from molt_hpc.plan.calibrate_train import fastest_s, random_model, trainer_profile

SHAPE_CLASS = {0: "mfu_small", 2048: "mfu_medium", 6144: "mfu_large"}


def copy_gb_per_s(device, sync, mib: int) -> float:
    import torch

    src = torch.ones(mib << 18, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    return 2 * src.nbytes / fastest_s(lambda: dst.copy_(src), sync, 10) / 1e9


def matmul_tflops(device, sync, n: int, dtype) -> float:
    import torch

    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n**3 / fastest_s(lambda: a @ b, sync, 10, warmup=2) / 1e12


def engine_step_s(model, cfg: MoltConfig, device, sync, rows: int, context: int) -> float:
    """Seconds of one step of the engine's scheduler with `rows` rows decoding at about `context` tokens:
    the whole step (sampling, the read-back, each row's bookkeeping), from two rounds of different lengths
    whose difference leaves their prefill out."""
    from concurrent.futures import Future

    import torch

    from molt_hpc.engine.batch import Row
    from molt_hpc.engine.main import model_runner
    from molt_hpc.engine.sampling import SamplingParams
    from molt_hpc.engine.scheduler import Scheduler

    short, long = 8, 40
    eng = cfg.engines.model_copy(update={"max_batch": rows, "max_model_len": context + long + 8})
    runner = model_runner(model.eval(), device, eng, None, graphs=True)
    vocab = model.config.get_text_config().vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(4, vocab, (rows, context), generator=g).tolist()

    def round_s(tokens: int) -> float:
        sched = Scheduler(runner, eos_ids=set(), max_batch=rows, max_model_len=eng.max_model_len, seed=0)
        for p in prompts:
            sched.submit(Row(list(p), SamplingParams(max_tokens=tokens, ignore_eos=True, top_k=0), Future()))
        return fastest_s(sched.drain, sync, 1, warmup=0)

    round_s(long)  # captures the graphs, warms the allocator
    return (min(round_s(long) for _ in range(3)) - min(round_s(short) for _ in range(3))) / (long - short)


def full_rows(cfg: MoltConfig, device) -> int:
    """The rows of a full batch the calibration decodes: `engines.max_batch`, at most 128 (32 on a CPU)."""
    return max(8, min(cfg.engines.max_batch, 128 if device.type == "cuda" else 32))


def engine_overhead_ms(model, cfg: MoltConfig, arch, device, sync, bandwidth: float) -> tuple[float, float]:
    """(fixed ms, ms per row) of an engine step beyond its memory time, fitted through a step of a few rows
    and one of a full batch."""
    b = 4 if cfg.model.dtype == "float32" else 2
    eff = cfg.plan.cuda.decode_efficiency if device.type == "cuda" else cfg.plan.cpu.decode_efficiency
    context = 64
    few, full = 4, full_rows(cfg, device)
    over = {}
    for rows in (few, full):
        memory = b * (arch.params + rows * context * arch.kv_bytes_per_token(1, b)) / (bandwidth * 1e9 * eff)
        over[rows] = max(0.0, engine_step_s(model, cfg, device, sync, rows, context) - memory) * 1e3
    per_row = max(0.0, (over[full] - over[few]) / (full - few))
    return max(0.0, over[few] - few * per_row), per_row


def prefill_host_s(model, cfg: MoltConfig, device, sync) -> float:
    """Seconds of a prefill of one 8-token row through the engine's own runner (on a GPU its prefill into the
    slot cache, replayed from a CUDA graph after the first): launches and host work alone."""
    from molt_hpc.engine.main import model_runner

    eng = cfg.engines.model_copy(update={"max_batch": 8, "max_model_len": 64})
    runner = model_runner(model.eval(), device, eng, None, graphs=True)
    return fastest_s(lambda: runner.prefill([[5] * 8]), sync, 8, warmup=2)


def calibrate(cfg: MoltConfig, device_kind: str) -> dict[str, float]:
    """The measured `[plan.<device_kind>]` numbers of this machine for `cfg`'s model."""
    import torch

    device = torch.device(device_kind)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    gpu = device.type == "cuda"
    out = {"memory_gb_per_s": copy_gb_per_s(device, sync, 2048 if gpu else 64)}
    out["matmul_tflops"] = matmul_tflops(device, sync, 8192 if gpu else 512, torch.bfloat16 if gpu else torch.float32)
    model, arch = random_model(cfg, device)
    # the trainer's part first: the engine's runner on a GPU fuses the model's projections in place
    micro_ms, sample_ms, mfu = trainer_profile(cfg, model, arch, device, sync, out["matmul_tflops"])
    fixed, per_row = engine_overhead_ms(model, cfg, arch, device, sync, out["memory_gb_per_s"])
    out["builtin_step_ms"], out["builtin_row_ms"] = fixed, per_row
    out["builtin_prefill_layer_ms"] = prefill_host_s(model, cfg, device, sync) * 1e3 / arch.layers
    if gpu:  # on a CPU a run's other processes share the cores too: the pair alone misprices it (docs/scale.md)
        shared = measure_shared(cfg, model, device, sync, full_rows(cfg, device), 3.0)
        out["shared_decode_rate"] = shared.decode_rate
        out["shared_train_slowdown"] = max(1.0, shared.train_slowdown)
    out[SHAPE_CLASS[max(k for k in SHAPE_CLASS if arch.hidden >= k)]] = mfu
    out["train_micro_batch_ms"], out["train_sample_ms"] = micro_ms, sample_ms
    return out


SHARED = ("shared_decode_rate", "shared_train_slowdown")
"""Measured on a GPU but printed commented out: priced with them the SmolLM2 recipe's step came out further
from its run (2.44x short) than in sequence (1.77x), since the live engine process is slower than its kernels'
sharing explains (docs/scale.md). Uncomment them to price a shared device with the pair."""


def calibration_text(values: dict[str, float], device_kind: str) -> str:
    """The numbers as a `[plan.<device>]` TOML section and as `--set` overrides; the shared-device pair (`SHARED`)
    as comments."""
    kept = {k: v for k, v in values.items() if k not in SHARED}
    lines = [f"[plan.{device_kind}]  # measured by molt-hpc plan --calibrate"]
    lines += [f"{k} = {v:.4g}" for k, v in kept.items()]
    if shared := {k: v for k, v in values.items() if k in SHARED}:
        lines.append("# the shared device, measured; in sequence prices a run closer (docs/scale.md):")
        lines += [f"# {k} = {v:.4g}" for k, v in shared.items()]
    sets = " ".join(f"--set plan.{device_kind}.{k}={v:.4g}" for k, v in kept.items())
    return "\n".join([*lines, "", f"# or: {sets}"])


def calibrate_here(cfg: MoltConfig) -> str:
    """Calibrate the GPU when this machine has one, else the CPU; the text to paste into a config."""
    import torch

    kind = "cuda" if torch.cuda.is_available() else "cpu"
    return calibration_text(calibrate(cfg, kind), kind)
