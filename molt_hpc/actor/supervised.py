"""The supervised stages' task in the trainer's loop (`molt-hpc sft`, `molt-hpc rm train`): `main(cfg, run_dir)`.

The same trainer as RL (`trainer.Trainer`: resume, seeds, restore, signals and control files,
checkpoints, `metrics.jsonl` and the step line), fed differently. `StageTask` owns what the stages
share: the datasets and their length-balanced walk (`datasets.StepOrder`, its position saved as the
run state's `data_position`), the trained model with FSDP2 and its AdamW (`build`), packed or padded
micro-batches (`packing`), the optimizer step (`step.optimizer_step`) and its metrics (`step.Meter`),
and the held-out evaluation at step 0, every `eval_every` steps and at the end. A `Stage`
(`sft.SftStage`, `rm.RewardStage`) adds what differs: its model part and expected shapes, how rows
become an `Experience`, its per-micro-batch loss and its evaluation metrics. There are no engines,
no refit and no buffer.
"""

import time
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from molt_hpc.actor import build, state
from molt_hpc.actor.control import Control, Requests
from molt_hpc.actor.packing import rank_micro_batches, sequence_layout
from molt_hpc.actor.step import Meter, optimizer_step
from molt_hpc.actor.task import Task
from molt_hpc.actor.trainer import Trainer
from molt_hpc.actor.world import World, run_rank
from molt_hpc.algorithm import Experience
from molt_hpc.checkpoint import check_shapes
from molt_hpc.config import MoltConfig
from molt_hpc.config.stages import SupervisedData
from molt_hpc.datasets import ReplyMarkers, StepOrder
from molt_hpc.log import get_logger
from molt_hpc.models import load_tokenizer, pad_token_id
from molt_hpc.models.sharded import meta_model
from molt_hpc.rundir import RunDir


class Stage(Protocol):
    """What a supervised stage adds to the trainer."""

    part: str
    """The trained model's kind (`build.load_model`'s role) and its name in checkpoints: `policy`, `reward`."""
    section: SupervisedData
    dataset: Any
    """The dataset class: `load(path, section, tokenizer, markers, limit=None)`, `lengths`, `key`, `bad_rows`."""
    row_tokens: int
    """Tokens of the longest row a micro-batch may have to hold (a packed micro-batch's default budget unit)."""
    loss_key: str
    """The record's name of the training loss (`sft_loss`, `rm_loss`)."""
    moe: Any
    """The policy's `MoeRouting` (aux losses, routing metrics) when it is an MoE model; None otherwise."""

    def expected_shapes(self, base: Path) -> dict[str, tuple[int, ...]]: ...

    def rows(self, data: Any) -> list[Any]:
        """The dataset's rows (samples, pairs), indexed as `StepOrder` counts them."""
        ...

    def experience(self, rows: list[Any], pad_id: int) -> Experience: ...

    def train(
        self, model: nn.Module, rows: list[Any], exp: Experience, mbs: list, world: World, meter: Meter
    ) -> dict[str, float]:
        """Forward and backward of this rank's micro-batches `mbs` of the step's rows; their metrics."""
        ...

    def evaluate(self, model: nn.Module, rows: list[Any], mbs: list, world: World) -> dict[str, float]: ...


class StageTask(Task):
    """A supervised stage's data, model and evaluation on one rank."""

    def __init__(self, cfg: MoltConfig, world: World, stage: Stage):
        self.cfg, self.world, self.stage = cfg, world, stage
        self.log = get_logger()
        self.pack_tokens: int | None = None
        self.pad_id = 0
        self.train_data: Any = None
        self.eval_data: Any = None
        self.order: StepOrder | None = None
        self.part: state.Trainable | None = None

    def resume_point(self, run: RunDir, base: Path, required: bool) -> Path | None:
        latest = state.latest_to_resume(self.cfg, run, required)
        if latest is not None:
            check_shapes(latest / self.stage.part, self.stage.expected_shapes(base))
        return latest

    def build(self, base: Path, ckpt: Path | None) -> list[state.Trainable]:
        self.load_data(base)
        self.part = self._build(ckpt / self.stage.part if ckpt else base)
        return [self.part]

    def load_data(self, base: Path) -> None:
        """The training and held-out rows (tokenized with `base`'s tokenizer) and the walk over them."""
        sec, stage, tokenizer = self.stage.section, self.stage, load_tokenizer(base)
        markers = ReplyMarkers.probe(tokenizer)
        self.train_data = stage.dataset.load(sec.data, sec, tokenizer, markers)
        if sec.eval_data:
            self.eval_data = stage.dataset.load(sec.eval_data, sec, tokenizer, markers, limit=sec.eval_max_rows)
        self.order = StepOrder(self.train_data.lengths, sec.length_buckets, self.cfg.run.seed, self.train_data.key)
        self.log.info(
            "%s: %d training rows from %s (%s bad), %s eval rows", stage.part, len(self.train_data), sec.data,
            sum(self.train_data.bad_rows.values()), len(self.eval_data) if self.eval_data else "no",
        )  # fmt: skip

    def _build(self, path: Path) -> state.Trainable:
        cfg, act, world, stage = self.cfg, self.cfg.actor, self.world, self.stage
        # how rows run (packing, CP) follows from the model's config and modules: read on the meta device
        meta = meta_model(path, critic=False, reward=stage.part == "reward", dtype=torch.float32,
                          attn=cfg.model.attn_implementation)  # fmt: skip
        docs, pack = sequence_layout(cfg, world, meta)
        if pack is not None:  # the stage's rows, not the rollouts', set a packed micro-batch's default size
            pack = act.max_tokens_per_micro_batch or act.micro_batch_size * stage.row_tokens
        self.pack_tokens = pack
        self.log.info("micro-batches: %s", f"packed, {pack} tokens" if pack else f"{act.micro_batch_size} padded rows")
        model = build.load_model(path, cfg, world, stage.part, documents=docs)  # type: ignore[arg-type]
        self.pad_id = pad_token_id(model.config)
        if stage.part == "policy":  # an MoE policy: its routers in fp32, its aux losses (no replay: no engines)
            from molt_hpc.actor.moe_router import MoeRouting

            stage.moe = MoeRouting.for_policy(model, cfg)
        return build.trainable(stage.part, model, cfg, act.lr)

    def micro_batches(self, rows: list[Any]) -> tuple[Experience, list]:
        """`rows` as one batch, and this rank's micro-batches of it."""
        exp = self.stage.experience(rows, self.pad_id)
        index = torch.arange(exp.sequences.shape[0])
        return exp, rank_micro_batches(exp, index, self.cfg.actor.micro_batch_size, self.pack_tokens, self.world)

    def restore(self, run_state: dict[str, Any]) -> None:
        assert self.order is not None
        self.order.restore(run_state["data_position"])

    def run_state(self) -> dict[str, Any]:
        assert self.order is not None
        return {"data_position": self.order.state(), "stage": self.cfg.run.stage}

    def next_batch(self, version: int, control: Control) -> tuple[list[int] | None, Requests]:
        """The next `batch_size` row indices, taken only once a checkpoint asked for now has saved the walk."""
        assert self.order is not None
        req = control.poll()
        if req.checkpoint or req.stop:
            return None, req
        return self.order.take(self.stage.section.batch_size), req

    def train(self, batch: list[int]) -> dict[str, Any]:
        assert self.part is not None
        meter = Meter()
        rows = self.stage.rows(self.train_data)
        rows = [rows[i] for i in batch]
        exp, mbs = self.micro_batches(rows)
        stats = self.stage.train(self.part.model, rows, exp, mbs, self.world, meter)
        meter.update("policy")
        out = meter.reduce()
        out[self.stage.loss_key] = out.pop("loss", 0.0)
        norm = optimizer_step(self.part, self.cfg.actor.grad_clip)
        out.update(lr=self.part.optimizer.param_groups[0]["lr"], grad_norm=norm)
        self.part.scheduler.step()
        return {**out, **stats}

    def evaluate(self, step: int) -> dict[str, float]:
        """The held-out metrics at `step` (none without `eval_data`)."""
        if self.eval_data is None:
            return {}
        assert self.part is not None
        t0 = time.perf_counter()
        rows = self.stage.rows(self.eval_data)
        out = self.stage.evaluate(self.part.model, rows, self.micro_batches(rows)[1], self.world)
        reshard(self.part.model)
        self.log.info("eval at step %d: %s (%.1fs)", step, _fmt(out), time.perf_counter() - t0)
        return out

    def after_step(self, step: int, batch: list[int]) -> dict[str, Any]:
        if step % self.stage.section.eval_every == 0 or step == self.cfg.run.steps:
            return self.evaluate(step)
        return {}

    def start(self, step: int) -> dict[str, Any] | None:
        if step == 0 and self.eval_data is not None:
            return {"step": 0, **self.evaluate(step)}
        return None


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
    The shutdown is RL's: metrics closed, a barrier on a clean end, the groups destroyed; the entry point
    then leaves through `end_process`."""
    run = RunDir(Path(run_dir).absolute())
    return run_rank(cfg, lambda world: Trainer(cfg, run, world, StageTask(cfg, world, make_stage(cfg)), resume))
