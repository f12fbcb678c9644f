"""Checkpoints written behind the training (`checkpoint.background`): a step pays for the host copies only.

`state.save` writes a checkpoint in the trainer's time: the weights gathered and written, the optimizer's
DCP files, the hashes of the manifest, the publication. On one H200 that was 3.3-5.5 s for SmolLM2-135M,
15% of a 300-s run that saves every 20 steps. Here the step pays for what needs the training's state: the
weights gathered into rank 0's memory (`full_buckets` never shares memory with a parameter), the
optimizer state staged into host memory by DCP's `async_save`, the RNG states. The files, the manifest
and the publication follow on a thread; DCP's own collective finish runs on a gloo group of this saver's,
so it never meets the training's collectives. Everything else is `state.save`'s: the same files, bytes
and publication rule, so a checkpoint is whole once `latest` names it, and a crash mid-write leaves a
temp directory the next save removes.

One save is in flight at a time: the next one, a stop and the end wait for it. Its run state (the
groups it covers) is handed back once it is published, so the buffer acks them only then. While a save
is in flight the host holds one more copy of the weights and of the optimizer state.
"""

from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from molt_hpc import checkpoint as ck
from molt_hpc.actor import lora
from molt_hpc.actor.state import StableWriter, Trainable, full_run_state, rng_state, save_model, write_model
from molt_hpc.actor.weights import full_buckets, plan_buckets
from molt_hpc.actor.world import World, gather_all, share


class SaveBehind:
    """The checkpoint in flight on this rank: started in the step, finished on a thread."""

    def __init__(self, world: World):
        self.world = world
        self.group = dist.new_group(backend="gloo")  # every rank creates it, in the same order
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="checkpoint")
        self.pending: tuple[Future, dict[str, Any], Path] | None = None

    def start(self, root: Path, step: int, parts: list[Trainable], run_state: dict[str, Any], *, tokenizer_src: Path,
              shard_bytes: int, keep_last: int, save_optimizer: bool) -> None:  # fmt: skip
        """Begin the checkpoint of `step` (every rank calls): the collective parts now, the writing behind."""
        assert self.pending is None, "wait() for the save in flight first"
        world = self.world
        tmp = Path(share(str(ck.begin(root, step)) if world.is_main else None))
        weights = {}
        for part in parts:
            if lora.has_adapters(part.model):  # an adapter is small: written now, as `state.save` does
                save_model(world, part.model, tmp / part.name, tokenizer_src, shard_bytes)
                continue
            plan = plan_buckets(part.model, shard_bytes)
            weights[part.name] = list(full_buckets(part.model, plan, keep=world.is_main))
        optim = None
        if save_optimizer:
            state = {p.name: get_optimizer_state_dict(p.model, p.optimizer) for p in parts}
            optim = dcp.async_save(state, storage_writer=StableWriter(str(tmp / "optim")), process_group=self.group)
        rng = gather_all(rng_state())
        full = full_run_state(world, step, parts, run_state, rng, save_optimizer) if world.is_main else None
        models = {p.name: p.model for p in parts}
        job = self.pool.submit(self._finish, root, tmp, step, keep_last, weights, models, tokenizer_src, optim, full)
        self.pending = (job, run_state, root / ck.step_name(step))

    def _finish(self, root, tmp, step, keep_last, weights, models, tokenizer_src, optim, full) -> None:
        """The writing (on the saver's thread): optimizer files, weights, run state, manifest, publication."""
        if optim is not None:
            optim.result()  # DCP's finish gathers every rank's writes: the optimizer files are whole
        if not self.world.is_main:
            return
        for name, buckets in weights.items():
            write_model(models[name], tmp / name, buckets, tokenizer_src, len(buckets))
        ck.write_json(tmp / ck.RUN_STATE, full)
        ck.write_manifest(tmp)
        ck.publish(root, tmp, step, keep_last)

    def done(self) -> bool:
        """Whether no save is in flight or the one in flight has finished (this rank's part of it)."""
        return self.pending is None or self.pending[0].done()

    def wait(self) -> tuple[dict[str, Any], Path] | None:
        """Block until the save in flight is published; its run state and path (None: none was in flight).
        A failed write raises here, in the trainer's thread."""
        if self.pending is None:
            return None
        job, run_state, path = self.pending
        self.pending = None
        job.result()
        return run_state, path

    def close(self) -> None:
        """Let a save still being written finish (a clean end has waited for it already; after an error
        its temp directory is what the next save removes)."""
        self.pool.shutdown(wait=True)
