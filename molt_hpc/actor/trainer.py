"""The trainer's one loop, for RL and the supervised stages alike; `main(cfg, run_dir)` is RL's entry point.

`Trainer` owns the skeleton every kind of training shares: the log-prob kernel check, the model's
resolution, the checkpoint to resume from, the seeds, the optimizer/schedule/RNG restore, signals and
control files (`control`), `metrics.jsonl` and the step line, checkpoints (once per step boundary, every
`checkpoint.interval` steps and at the end) and the loop itself. A `task.Task` adds what differs: its
models, its batches, its update and the work around a step. RL's task (`rl.RlTask`) is fed by the replay
buffer and refits the engines; the supervised stages' (`supervised.StageTask`) walk a dataset and evaluate.

Per step: wait for a batch (serving checkpoint/stop requests meanwhile), train, the task's work after a
step (RL: refit every `refit.interval` steps; stages: held-out evaluation), a checkpoint when due, one
record. After `run.steps` steps: the task's finish, a final checkpoint, `control/done`, exit 0. A stop
request checkpoints and exits 0.
"""

import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from molt_hpc.actor import state
from molt_hpc.actor.control import Control, Requests
from molt_hpc.actor.rl import RlTask
from molt_hpc.actor.save_behind import SaveBehind
from molt_hpc.actor.task import Task
from molt_hpc.actor.world import World, from_main, run_rank
from molt_hpc.algorithm.logprob_kernels import check_kernel
from molt_hpc.config import MoltConfig
from molt_hpc.log import MetricsWriter, get_logger, step_line
from molt_hpc.models import resolve_model
from molt_hpc.rundir import RunDir


class Trainer:
    """Everything one rank holds while training: the task, the step, checkpoints, control and metrics."""

    def __init__(self, cfg: MoltConfig, run: RunDir, world: World, task: Task, resume: bool):
        self.cfg, self.rundir, self.world, self.task = cfg, run, world, task
        self.log = get_logger()
        check_kernel(cfg.actor.logprob_kernel, world.device)  # before minutes of loading
        self.base = from_main(lambda: resolve_model(cfg.model, run.models), world)
        ckpt = from_main(lambda: task.resume_point(run, self.base, resume), world)
        random.seed(cfg.run.seed)
        np.random.seed(cfg.run.seed)
        torch.manual_seed(cfg.run.seed)
        t0 = time.perf_counter()
        self.parts = task.build(self.base, ckpt)
        self.log.info(
            "%d rank(s) on %s; models from %s ready in %.1fs", world.size, world.device, ckpt or self.base,
            time.perf_counter() - t0,
        )  # fmt: skip
        self.step = 0
        self.saved_step: int | None = None
        self.saver = SaveBehind(world) if cfg.checkpoint.background else None
        if ckpt is not None:
            rs = state.restore(world, ckpt, self.parts, cfg.run.seed)
            self.step, self.saved_step = rs["step"], rs["step"]
            task.restore(rs)
            self.log.info("resumed from %s: step %d", ckpt, self.step)
        self.control = Control(run.path, world.is_main)
        self.metrics = MetricsWriter(run.metrics, source="actor") if world.is_main else None

    @property
    def version(self) -> int:
        return self.step

    def checkpoint(self, behind: bool = False) -> None:
        """Save the state at the current step boundary (once per step). `behind`: the files are written on
        the saver's thread (`checkpoint.background`); otherwise this returns once the save is published."""
        if self.saved_step != self.step:
            self.published(wait=True)  # one save in flight at a time
            t0 = time.perf_counter()
            run_state = {"version": self.version, **self.task.run_state(), "model": str(self.base)}
            c = self.cfg.checkpoint
            how = {"tokenizer_src": self.base, "shard_bytes": c.shard_mb << 20, "keep_last": c.keep_last,
                   "save_optimizer": c.save_optimizer}  # fmt: skip
            self.saved_step = self.step
            if behind and self.saver is not None:
                self.saver.start(self.rundir.checkpoints, self.step, self.parts, run_state, **how)
                self.log.info("checkpoint of step %d started (%.2fs in the step)", self.step, time.perf_counter() - t0)
            else:
                path = state.save(self.world, self.rundir.checkpoints, self.step, self.parts, run_state, **how)
                self.task.saved(run_state)
                self.log.info("checkpoint %s (%.2fs)", path.name, time.perf_counter() - t0)
        if not behind:
            self.published(wait=True)

    def published(self, wait: bool) -> None:
        """Hand a finished background save's run state to the task (RL acks the groups it covers)."""
        if self.saver is None or not (wait or self.saver.done()):
            return
        done = self.saver.wait()
        if done is not None:
            self.task.saved(done[0])
            self.log.info("checkpoint %s published", done[1].name)

    def serve(self, req: Requests) -> None:
        if req.checkpoint or req.stop:
            self.checkpoint()
            self.control.served(req)
        self.task.serve(req, self.version)

    def write(self, record: dict[str, Any]) -> None:
        if self.metrics is not None:
            self.metrics.write(record)
        self.log.info(step_line(record["step"], record))

    def close(self) -> None:
        """Close what this rank opened: the task's (RL: the refit sender's connections and TCPStore), metrics."""
        self.task.close()
        if self.saver is not None:
            self.saver.close()
        if self.metrics is not None:
            self.metrics.close()

    def run(self) -> int:
        first = self.task.start(self.step)
        if first is not None:
            self.write(first)
        while self.step < self.cfg.run.steps:
            t0 = time.perf_counter()
            batch, req = self.task.next_batch(self.version, self.control)
            self.serve(req)
            if req.stop:
                self.log.info("stopped at step %d after a checkpoint", self.step)
                return 0
            if batch is None:
                continue
            self.train(batch, wait_s=time.perf_counter() - t0)
        self.task.finish(self.step)
        self.checkpoint()
        self.control.mark_done()
        self.log.info("training finished after %d steps", self.step)
        return 0

    def train(self, batch: Any, wait_s: float) -> dict[str, Any]:
        """One step: the update, the task's work after it, a checkpoint when due; the record it writes."""
        t0 = time.perf_counter()
        fields = self.task.train(batch)
        step_s = time.perf_counter() - t0
        self.step += 1
        fields.update(self.task.after_step(self.step, batch))
        checkpoint_s = None
        if self.cfg.checkpoint.interval and self.step % self.cfg.checkpoint.interval == 0:
            t1 = time.perf_counter()
            self.checkpoint(behind=True)
            checkpoint_s = time.perf_counter() - t1
        self.published(wait=False)
        record = {
            "step": self.step, "version": self.version, **fields, "step_s": step_s,
            "tokens_per_s": fields.get("tokens", 0) / step_s, **self.task.step_end(wait_s, checkpoint_s),
        }  # fmt: skip
        self.write(record)
        return record


def main(cfg: MoltConfig, run_dir: str | Path, *, resume: bool = False) -> int:
    """Train the RL run in `run_dir` on this rank (torchrun starts one per rank); returns the exit code.

    The shutdown is ordered: the refit sender's connections and store close, the metrics file closes,
    every rank meets at a barrier (a clean end only), then the process groups are destroyed. The
    entry point then leaves through `end_process`, past the interpreter teardown that torch's own
    threads do not survive.
    """
    run = RunDir(Path(run_dir).absolute())
    return run_rank(cfg, lambda world: Trainer(cfg, run, world, RlTask(cfg, run, world), resume))
