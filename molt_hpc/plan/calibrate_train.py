"""The trainer's own step, timed for `plan --calibrate`: `train_step` (experience, advantages, the log-prob
kernel and the loss, FSDP2's hooks, the gradient clip, AdamW) on the config's model with random weights,
built the trainer's way (`actor.rl.build_models`: fp32 master weights, `parallelize`, packing, the reference
and critic the algorithm uses) in a world of one rank, on synthetic groups (one a mini-batch) of full-length samples.

Three steps, each the fastest of a few:

- two of short rows at the config's updates a step (`ppo_epochs × mini_batches`), host time alone: four
  micro-batches of one sample, and one micro-batch of sixteen, in each mini-batch; solved together they
  give what the speed model charges per micro-batch and per update (`train_micro_batch_ms`) and per
  sample (`train_sample_ms`);
- full rows at the config's own micro-batching: the speed model's FLOPs for that step over the time left
  beside its host part, over the measured matmul rate, is the MFU of the model's shape class.

A plain forward, backward and AdamW step of the model misses what the trainer adds: on one H100 the
SmolLM2 recipe's trainer took 4.2x a plain step's host time per micro-batch (`docs/scale.md`).
"""

import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from molt_hpc.config import MoltConfig
from molt_hpc.plan.arch import Arch, arch_from_config, load_hf_config
from molt_hpc.plan.shape import shape_of
from molt_hpc.plan.speed import Workload, train_flops
from molt_hpc.trajectory import Group, Trajectory

HOST_MICRO, HOST_JOINED, HOST_SEQ = 4, 16, 16
"""The host steps: samples of `HOST_SEQ` tokens, `HOST_MICRO` micro-batches of one or one of `HOST_JOINED`."""


def random_model(cfg: MoltConfig, device):
    """The config's model with seeded random weights on `device`, and its `Arch`."""
    import torch

    from molt_hpc.models.load import lm_class

    config, _ = load_hf_config(cfg.model)
    dtype = torch.float32 if cfg.model.dtype == "float32" else torch.bfloat16
    torch.manual_seed(0)
    model = lm_class(config).from_config(config, dtype=dtype).to(device)
    return model, arch_from_config(config)


def shaped(cfg: MoltConfig, groups: int, samples: int, seq: int, **actor) -> MoltConfig:
    """`cfg` training `groups` groups of `samples` samples of `seq` tokens (an eighth of them prompt) a step,
    nothing offloaded (the speed model adds the offload's transfers on its own), `actor` fields replaced."""
    prompt = max(1, seq // 8)
    ro = cfg.rollout.model_copy(update={"n_samples": samples, "max_total_tokens": seq, "max_new_tokens": seq - prompt})
    act = cfg.actor.model_copy(update={"groups_per_step": groups, "offload": "none", **actor})
    return cfg.model_copy(update={
        "rollout": ro, "actor": act, "data": cfg.data.model_copy(update={"max_prompt_tokens": prompt}),
        "engines": cfg.engines.model_copy(update={"max_model_len": max(seq, cfg.engines.max_model_len)}),
    })  # fmt: skip


def synthetic_groups(groups: int, samples: int, seq: int, vocab: int) -> list[Group]:
    """`groups` groups of `samples` samples of exactly `seq` tokens, rewards alternating so that every sample
    has an advantage (a group of equal rewards would train nothing). A step's mini-batches cut it between
    groups: one group a mini-batch."""
    rng = random.Random(0)
    prompt = max(1, seq // 8)
    n = seq - prompt
    out = []
    for g in range(groups):
        rows = []
        for i in range(samples):
            toks = [rng.randrange(4, vocab) for _ in range(seq)]
            lps = [-rng.uniform(0.5, 3.0) for _ in range(n)]
            rows.append(Trajectory(toks, prompt, [(prompt, seq)], lps, [0] * n, float(i % 2), rollout_id=f"c{g}.{i}"))
        out.append(Group(f"calibrate{g}", f"calibrate{g}", rows))
    return out


def fastest_s(fn, sync, repeats: int, warmup: int = 1) -> float:
    """Fastest seconds of `fn` over `repeats` runs after `warmup` runs (first calls allocate and pick kernels):
    what the device does undisturbed, the least sensitive to other work on the machine."""
    for _ in range(warmup):
        fn()
    sync()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t0)
    return min(out)


def step_s(cfg: MoltConfig, models, world, groups: list[Group], sync) -> float:
    """Fastest seconds of the trainer's step on `groups` (after a warm-up, which creates the optimizer's state)."""
    from molt_hpc.actor.step import train_step

    return fastest_s(lambda: train_step(groups, cfg, models, world, pad_id=0), sync, 3)


@dataclass(frozen=True)
class HostStep:
    """A step of short samples, timed for host time alone: `samples` in each of the config's mini-batches,
    `per_micro` of them a micro-batch; what the speed model charges it for, per `train_micro_batch_ms` (each
    micro-batch and each update) and per `train_sample_ms` (each sample each epoch)."""

    cfg: MoltConfig
    samples: int
    micro_units: int
    sample_units: int


def host_steps(cfg: MoltConfig) -> tuple[HostStep, HostStep]:
    """Two host steps whose times separate the parts: `HOST_MICRO` micro-batches of one sample each, and
    one micro-batch of `HOST_JOINED` samples, in each mini-batch."""
    act = cfg.actor
    out = []
    for samples, per_micro in ((HOST_MICRO, 1), (HOST_JOINED, HOST_JOINED)):
        micro = samples // per_micro
        host = shaped(cfg, act.mini_batches, samples, HOST_SEQ, micro_batch_size=per_micro,
                      max_tokens_per_micro_batch=per_micro * HOST_SEQ)  # fmt: skip
        epochs = act.ppo_epochs * act.mini_batches
        out.append(HostStep(host, samples, epochs * (micro + 1), epochs * samples))
    return out[0], out[1]


def host_parts(a: HostStep, ta: float, b: HostStep, tb: float) -> tuple[float, float]:
    """(seconds per micro-batch or update, seconds per sample) that give both steps' times; a part the
    noise would make negative is 0 and the other alone explains the steps."""
    det = a.micro_units * b.sample_units - b.micro_units * a.sample_units
    micro = (ta * b.sample_units - tb * a.sample_units) / det
    sample = (tb - b.micro_units * micro) / b.sample_units
    if sample < 0:
        return (ta + tb) / (a.micro_units + b.micro_units), 0.0
    if micro < 0:
        return 0.0, (ta + tb) / (a.sample_units + b.sample_units)
    return micro, sample


def trainer_models(cfg: MoltConfig, model, world):
    """The trainer's models of `cfg` (`actor.rl.build_models`) with `model`'s weights (random ones)."""
    from molt_hpc.actor.rl import build_models

    with tempfile.TemporaryDirectory(prefix="molt-calibrate-") as tmp:
        model.save_pretrained(Path(tmp))  # the trainer reads its weights from a checkpoint directory
        return build_models(cfg, world, Path(tmp), None)


def trainer_profile(cfg: MoltConfig, model, arch: Arch, device, sync, tflops: float) -> tuple[float, float, float]:
    """(`train_micro_batch_ms`, `train_sample_ms`, MFU) of the trainer's step of `cfg`'s model (`model`: its
    random weights)."""
    import torch.distributed as dist

    from molt_hpc.actor.packing import token_budget
    from molt_hpc.actor.world import close_world, init_world

    groups, seq = cfg.actor.mini_batches, 512 if device.type == "cuda" else 128
    samples = max(2, 8 // groups)  # about 8 full rows, a group a mini-batch
    busy_cfg = shaped(cfg, groups, samples, seq)
    owned = not dist.is_initialized()  # a world this call starts is closed by it
    world = init_world(busy_cfg.actor.model_copy(update={"device": device.type}))
    try:
        models = trainer_models(busy_cfg, model, world)
        vocab = model.config.get_text_config().vocab_size
        packed, times = models.pack_tokens, []
        for host in host_steps(cfg):
            models.pack_tokens = token_budget(host.cfg) if packed else None
            short = synthetic_groups(groups, host.samples, HOST_SEQ, vocab)
            times.append(step_s(host.cfg, models, world, short, sync))
        models.pack_tokens = packed
        busy = step_s(busy_cfg, models, world, synthetic_groups(groups, samples, seq, vocab), sync)
    finally:
        if owned:
            close_world(barrier=False)
    a, b = host_steps(cfg)
    micro_s, sample_s = host_parts(a, times[0], b, times[1])
    act = busy_cfg.actor
    shape = shape_of(busy_cfg, 1, device.type, arch)
    overhead = act.ppo_epochs * (act.mini_batches * (shape.micro_batches + 1) * micro_s + groups * samples * sample_s)
    flops = train_flops(arch, busy_cfg, Workload(groups * samples, seq // 8, seq - seq // 8))
    return micro_s * 1e3, sample_s * 1e3, min(1.0, flops / max(busy - overhead, 1e-9) / (tflops * 1e12))
