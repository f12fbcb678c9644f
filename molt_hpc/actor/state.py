"""Saving and restoring the trainer's whole state through `molt_hpc.checkpoint` (collective calls).

Weights go out as HF-layout safetensors shards gathered bucket by bucket (rank 0 writes them);
optimizer state goes through torch DCP (every rank writes its shard; a load reshards onto any world
size); the run state (step, version, schedulers, every rank's RNG, buffer and data positions) is one
JSON. Rank 0 verifies and publishes; the other ranks wait at a barrier, so a save returns on every
rank only when the checkpoint is whole. `latest_to_resume` is the rule of which checkpoint a run resumes from.
"""

import base64
import random
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from molt_hpc import checkpoint as ck
from molt_hpc.actor import lora
from molt_hpc.actor.weights import bucket_count_bytes, full_buckets, plan_buckets
from molt_hpc.actor.world import World, gather_all, share
from molt_hpc.config import MoltConfig
from molt_hpc.log import get_logger
from molt_hpc.rundir import RunDir


@dataclass
class Trainable:
    """A trained model with its optimizer and schedule, saved under `name` (`policy`, `critic`)."""

    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any


class StableWriter(FileSystemWriter):
    """A DCP writer that records no per-save id or path, so saving the same state gives the same bytes."""

    def storage_meta(self):
        return None


def save_model(world: World, model: nn.Module, out: Path, tokenizer_src: Path, shard_bytes: int) -> None:
    """`model` in HF layout under `out`: safetensors shards + index, config, tokenizer files; a LoRA
    policy as a PEFT adapter directory over the base in `tokenizer_src` (`lora.save_adapter`)."""
    if lora.has_adapters(model):
        lora.save_adapter(world, model, out, tokenizer_src)
        return
    plan = plan_buckets(model, shard_bytes)
    if world.is_main:
        write_model(model, out, full_buckets(model, plan, keep=True), tokenizer_src, len(plan))
    else:
        for _ in full_buckets(model, plan, keep=False):  # every rank takes part in each bucket's gather
            pass


def write_model(model: nn.Module, out: Path, buckets: Iterable[dict[str, torch.Tensor]], tokenizer_src: Path,
                total: int) -> None:  # fmt: skip
    """Write `total` gathered `buckets` of `model` in HF layout under `out` (rank 0; no collective)."""
    weight_map: dict[str, str] = {}
    for i, bucket in enumerate(buckets):
        weight_map.update(ck.write_shard(out, i, total, bucket))
    ck.write_index(out, weight_map, bucket_count_bytes(model))
    model.config.save_pretrained(str(out))
    if getattr(model, "generation_config", None) is not None and model.can_generate():
        model.generation_config.save_pretrained(str(out))
    ck.copy_tokenizer_files(tokenizer_src, out)


def full_run_state(world: World, step: int, parts: list[Trainable], run_state: dict[str, Any], rng: list[Any],
                   save_optimizer: bool) -> dict[str, Any]:  # fmt: skip
    """The run state file of a checkpoint: the task's keys and what the trainer adds (step, ranks, RNGs, schedules)."""
    return {
        **run_state,
        "step": step,
        "world_size": world.size,
        "rng": rng,
        "schedulers": {p.name: p.scheduler.state_dict() for p in parts},
        "optimizer": save_optimizer,
    }


def save(
    world: World,
    root: Path,
    step: int,
    parts: list[Trainable],
    run_state: dict[str, Any],
    *,
    tokenizer_src: Path,
    shard_bytes: int,
    keep_last: int,
    save_optimizer: bool = True,
) -> Path:
    """Write and publish the checkpoint of `step` (every rank calls); returns its final path."""
    tmp = Path(share(str(ck.begin(root, step)) if world.is_main else None))
    for part in parts:
        save_model(world, part.model, tmp / part.name, tokenizer_src, shard_bytes)
    if save_optimizer:
        optim = {p.name: get_optimizer_state_dict(p.model, p.optimizer) for p in parts}
        dcp.save(optim, storage_writer=StableWriter(str(tmp / "optim")))
    rng = gather_all(rng_state())
    if world.is_main:
        ck.write_json(tmp / ck.RUN_STATE, full_run_state(world, step, parts, run_state, rng, save_optimizer))
        ck.write_manifest(tmp)
        ck.publish(root, tmp, step, keep_last)
    dist.barrier()
    return root / ck.step_name(step)


def restore(world: World, ckpt: Path, parts: list[Trainable], seed: int) -> dict[str, Any]:
    """Load optimizer, schedule and RNG state from `ckpt` (weights are loaded when models are built)."""
    state = ck.read_run_state(ckpt)
    if state.get("optimizer", True):
        osd = {p.name: get_optimizer_state_dict(p.model, p.optimizer) for p in parts}
        dcp.load(osd, checkpoint_id=str(ckpt / "optim"))
        for p in parts:
            set_optimizer_state_dict(p.model, p.optimizer, osd[p.name])
    else:
        get_logger().warning("%s has no optimizer state (checkpoint.save_optimizer was off): AdamW starts fresh", ckpt)
    for p in parts:
        p.scheduler.load_state_dict(state["schedulers"][p.name])
    if state["world_size"] == world.size:
        set_rng_state(state["rng"][world.rank])
    else:
        # Per-rank random streams cannot be split or merged; restart them reproducibly instead.
        get_logger().warning(
            "%s was saved by %d ranks and resumes on %d: RNG streams are re-seeded from run.seed and the step",
            ckpt.name, state["world_size"], world.size,
        )  # fmt: skip
        reseed(seed, state["step"], world.rank)
    return state


def latest_to_resume(cfg: MoltConfig, run: RunDir, required: bool) -> Path | None:
    """The run's latest checkpoint, verified, when `checkpoint.resume` allows resuming from it (rank 0)."""
    latest = ck.latest_checkpoint(run.checkpoints)
    mode = "required" if required else cfg.checkpoint.resume
    if latest is None:
        if mode == "required":
            raise ValueError(f"nothing to resume: {run.checkpoints} has no checkpoint (no `latest`)")
        return None
    if mode == "never":
        raise ValueError(
            f"{run.path} already has checkpoint {latest.name} and checkpoint.resume = 'never': "
            "use a new run.name, or set checkpoint.resume = 'auto' to continue it"
        )
    ck.verify(latest)
    return latest


def reseed(seed: int, step: int, rank: int) -> None:
    s = ((seed * 1_000_003 + step) * 1009 + rank) % (2**31)
    random.seed(s)
    np.random.seed(s)
    torch.manual_seed(s)


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)


def rng_state() -> dict[str, Any]:
    """This process's random states (torch CPU and CUDA, Python, NumPy) as JSON-able values."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "torch": _b64(torch.get_rng_state()),
        "cuda": [_b64(s) for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else [],
        "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
        "numpy": [name, keys.tolist(), pos, has_gauss, cached],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(_unb64(state["torch"]))
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_unb64(s) for s in state["cuda"]])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
