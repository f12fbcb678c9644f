"""The trainer's loop for the supervised stages (`molt-hpc sft`, `molt-hpc rm train`): `main(cfg, run_dir)`.

The same trainer as RL, fed differently: the world and meshes (`world`), FSDP2 over a plain
transformers model (`parallelize`), AdamW and its schedule (`build`), packed or padded micro-batches
(`packing`), the optimizer step (`step.optimizer_step`) and its metrics (`step.Meter`), checkpoints
and resume (`state`), signals and control files (`control`), `metrics.jsonl` and the step line. A
stage (`sft.SftStage`, `rm.RewardStage`) adds what differs: the model it trains, its batches (a
length-balanced walk over a dataset instead of groups from the replay buffer) and its loss. There
are no engines, no refit and no buffer.

Per step: the next `batch_size` rows → this rank's micro-batches → forward, loss, backward → one
optimizer step. Held-out evaluation at step 0, every `eval_every` steps and at the end; a
checkpoint every `checkpoint.interval` steps and at the end. SIGTERM or `control/stop` checkpoints
and exits 0; SIGUSR1 or `control/checkpoint` checkpoints and goes on.
"""

import random
import time
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from molt_hpc.actor import build, state
from molt_hpc.actor.control import Control, Requests
from molt_hpc.actor.packing import sequence_layout
from molt_hpc.actor.step import Meter, optimizer_step
from molt_hpc.actor.trainer import latest_to_resume, on_main_rank
from molt_hpc.actor.world import World, run_rank
from molt_hpc.algorithm.logprob_kernels import check_kernel
from molt_hpc.checkpoint import check_shapes
from molt_hpc.config import MoltConfig
from molt_hpc.config.stages import SupervisedData
from molt_hpc.datasets import StepOrder
from molt_hpc.log import MetricsWriter, get_logger, step_line
from molt_hpc.models import load_tokenizer, pad_token_id, resolve_model
from molt_hpc.models.sharded import meta_model
from molt_hpc.rundir import RunDir


class Stage(Protocol):
    """What a supervised stage adds to the trainer."""

    part: str
    """The trained model's kind (`build.load_model`'s role) and its name in checkpoints: `policy`, `reward`."""
    section: SupervisedData
    row_tokens: int
    """Tokens of the longest row a micro-batch may have to hold (a packed micro-batch's default budget unit)."""
    loss_key: str
    """The record's name of the training loss (`sft_loss`, `rm_loss`)."""
    pack_tokens: int | None
    """Tokens of one packed micro-batch, None for padded rows (set by the trainer)."""
    pad_id: int
    """The model's pad token id (set by the trainer)."""
    moe: Any
    """The policy's `MoeRouting` (aux losses, routing metrics) when it is an MoE model; None otherwise."""

    def expected_shapes(self, base: Path) -> dict[str, tuple[int, ...]]: ...

    def load_data(self, tokenizer: Any) -> tuple[Any, Any | None]: ...

    def train(self, model: nn.Module, rows: list[int], world: World, meter: Meter) -> dict[str, float]: ...

    def evaluate(self, model: nn.Module, world: World) -> dict[str, float]: ...


class StageTrainer:
    """Everything one rank holds while training a stage."""

    def __init__(self, cfg: MoltConfig, run: RunDir, world: World, stage: Stage, resume: bool):
        self.cfg, self.rundir, self.world, self.stage = cfg, run, world, stage
        self.log = get_logger()
        check_kernel(cfg.actor.logprob_kernel, world.device)  # before minutes of loading
        self.base = on_main_rank(lambda: resolve_model(cfg.model, run.models), world)
        ckpt = on_main_rank(lambda: self._resume_point(resume), world)
        random.seed(cfg.run.seed)
        np.random.seed(cfg.run.seed)
        torch.manual_seed(cfg.run.seed)
        self.train_data, self.eval_data = stage.load_data(load_tokenizer(self.base))
        sec = stage.section
        self.order = StepOrder(self.train_data.lengths, sec.length_buckets, cfg.run.seed, self.train_data.key)
        self.log.info(
            "%s: %d training rows from %s (%s bad), %s eval rows", stage.part, len(self.train_data), sec.data,
            sum(self.train_data.bad_rows.values()), len(self.eval_data) if self.eval_data else "no",
        )  # fmt: skip
        self.part = self._build(ckpt / stage.part if ckpt else self.base)
        self.step = 0
        self.saved_step: int | None = None
        if ckpt is not None:
            rs = state.restore(world, ckpt, [self.part], cfg.run.seed)
            self.step = self.saved_step = rs["step"]
            self.order.restore(rs["data_position"])
            self.log.info("resumed from %s: step %d", ckpt, self.step)
        self.control = Control(run.path, world.is_main)
        self.metrics = MetricsWriter(run.metrics, source="actor") if world.is_main else None

    def _resume_point(self, required: bool) -> Path | None:
        latest = latest_to_resume(self.cfg, self.rundir, required)
        if latest is not None:
            check_shapes(latest / self.stage.part, self.stage.expected_shapes(self.base))
        return latest

    def _build(self, path: Path) -> state.Trainable:
        cfg, act, world, stage = self.cfg, self.cfg.actor, self.world, self.stage
        # how rows run (packing, CP) follows from the model's config and modules: read on the meta device
        meta = meta_model(path, critic=False, reward=stage.part == "reward", dtype=torch.float32,
                          attn=cfg.model.attn_implementation)  # fmt: skip
        docs, pack = sequence_layout(cfg, world, meta)
        if pack is not None:  # the stage's rows, not the rollouts', set a packed micro-batch's default size
            pack = act.max_tokens_per_micro_batch or act.micro_batch_size * stage.row_tokens
        stage.pack_tokens = pack
        self.log.info("micro-batches: %s", f"packed, {pack} tokens" if pack else f"{act.micro_batch_size} padded rows")
        model = build.load_model(path, cfg, world, stage.part, documents=docs)  # type: ignore[arg-type]
        stage.pad_id = pad_token_id(model.config)
        if stage.part == "policy":  # an MoE policy: its routers in fp32, its aux losses (no replay: no engines)
            from molt_hpc.actor.moe_router import MoeRouting

            stage.moe = MoeRouting.for_policy(model, cfg)
        opt = build.build_optimizer(model, act, act.lr)
        return state.Trainable(self.stage.part, model, opt, build.build_scheduler(opt, act, cfg.run.steps))

    def checkpoint(self) -> None:
        if self.saved_step == self.step:
            return
        t0 = time.perf_counter()
        c = self.cfg.checkpoint
        run_state = {"version": self.step, "data_position": self.order.state(), "model": str(self.base),
                     "stage": self.cfg.run.stage}  # fmt: skip
        path = state.save(
            self.world, self.rundir.checkpoints, self.step, [self.part], run_state, tokenizer_src=self.base,
            shard_bytes=c.shard_mb << 20, keep_last=c.keep_last, save_optimizer=c.save_optimizer,
        )  # fmt: skip
        self.saved_step = self.step
        self.log.info("checkpoint %s (%.2fs)", path.name, time.perf_counter() - t0)

    def evaluate(self) -> dict[str, float]:
        if self.eval_data is None:
            return {}
        t0 = time.perf_counter()
        out = self.stage.evaluate(self.part.model, self.world)
        reshard(self.part.model)
        self.log.info("eval at step %d: %s (%.1fs)", self.step, _fmt(out), time.perf_counter() - t0)
        return out

    def write(self, record: dict[str, Any]) -> None:
        if self.metrics is not None:
            self.metrics.write(record)
        self.log.info(step_line(record["step"], record))

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()

    def serve(self, req: Requests) -> None:
        if req.checkpoint or req.stop:
            self.checkpoint()
            self.control.served(req)

    def run(self) -> int:
        sec, steps = self.stage.section, self.cfg.run.steps
        if self.step == 0 and self.eval_data is not None:
            self.write({"step": 0, **self.evaluate()})
        while self.step < steps:
            req = self.control.poll()
            self.serve(req)
            if req.stop:
                self.log.info("stopped at step %d after a checkpoint", self.step)
                return 0
            record = self.train(self.order.take(sec.batch_size))
            if self.step % sec.eval_every == 0 or self.step == steps:
                record.update(self.evaluate())
            if self.cfg.checkpoint.interval and self.step % self.cfg.checkpoint.interval == 0:
                self.checkpoint()
            self.write(record)
        self.checkpoint()
        self.control.mark_done()
        self.log.info("training finished after %d steps", self.step)
        return 0

    def train(self, rows: list[int]) -> dict[str, Any]:
        t0 = time.perf_counter()
        meter = Meter()
        stats = self.stage.train(self.part.model, rows, self.world, meter)
        meter.update("policy")
        out = meter.reduce()
        out[self.stage.loss_key] = out.pop("loss", 0.0)
        norm = optimizer_step(self.part, self.cfg.actor.grad_clip)
        out.update(lr=self.part.optimizer.param_groups[0]["lr"], grad_norm=norm)
        self.part.scheduler.step()
        self.step += 1
        step_s = time.perf_counter() - t0
        return {"step": self.step, "version": self.step, **out, **stats, "step_s": step_s,
                "tokens_per_s": stats.get("tokens", 0) / step_s}  # fmt: skip


def reshard(model: nn.Module) -> None:
    """Put FSDP's sharded parameters back after no-grad forwards: the root keeps its gathered ones after a
    forward until a backward, and the optimizer (and a checkpoint of it) knows only the sharded ones."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _fmt(metrics: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.4f}" for k, v in metrics.items() if isinstance(v, float))


def make_stage(cfg: MoltConfig) -> Stage:
    if cfg.run.stage == "sft":
        from molt_hpc.actor.sft import SftStage

        return SftStage(cfg)
    from molt_hpc.actor.rm import RewardStage

    assert cfg.run.stage == "rm", f"run.stage = {cfg.run.stage!r} is not a supervised stage"
    return RewardStage(cfg)


def main(cfg: MoltConfig, run_dir: str | Path, *, resume: bool = False) -> int:
    """Train the stage of the run in `run_dir` on this rank (torchrun starts one per rank); the exit code.
    The shutdown is the RL trainer's: metrics closed, a barrier on a clean end, the groups destroyed;
    the entry point then leaves through `end_process`."""
    run = RunDir(Path(run_dir).absolute())
    return run_rank(cfg, lambda world: StageTrainer(cfg, run, world, make_stage(cfg), resume))
