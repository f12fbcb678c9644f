"""The actor pool's loop: `main(cfg, run_dir)` on every torchrun rank.

Set up (models, optimizers, or a checkpoint to resume from), refit the engines, then per step:
wait for a batch (serving checkpoint/stop requests and engine changes meanwhile), train, refit
every `refit.interval` steps, checkpoint every `checkpoint.interval` steps. After `run.steps`
steps: final refit and checkpoint, `control/done`, exit 0. A stop request checkpoints and exits 0.
"""

import random
import time
from pathlib import Path

import numpy as np
import torch

from molt_hpc import checkpoint as ck
from molt_hpc.actor import build, state
from molt_hpc.actor.control import Control, Requests
from molt_hpc.actor.feed import Feed, staleness_histogram
from molt_hpc.actor.memory import StepMemory
from molt_hpc.actor.moe_router import MoeRouting
from molt_hpc.actor.packing import sequence_layout
from molt_hpc.actor.step import Models, train_step
from molt_hpc.actor.sync import EngineSync
from molt_hpc.actor.vision import ImageInputs
from molt_hpc.actor.world import World, run_rank, share
from molt_hpc.algorithm.logprob_kernels import check_kernel
from molt_hpc.config import MoltConfig
from molt_hpc.log import MetricsWriter, get_logger, step_line
from molt_hpc.models import pad_token_id, resolve_model
from molt_hpc.models.sharded import meta_model
from molt_hpc.rundir import RunDir
from molt_hpc.trajectory import finished_reward
from molt_hpc.vision.processor import Vision, is_vision_model


def resume_point(cfg: MoltConfig, run: RunDir, base: Path, required: bool) -> Path | None:
    """The verified checkpoint to resume from, per `checkpoint.resume` (rank 0)."""
    latest = latest_to_resume(cfg, run, required)
    if latest is None:
        return None
    build.check_checkpoint_model(latest / "policy", base, lora_policy=cfg.actor.lora is not None)
    if cfg.algorithm.uses_critic:
        if not (latest / "critic").is_dir():
            raise ValueError(
                f"{latest} has no critic but algorithm.advantage = 'gae' needs one; resume with its algorithm"
            )
        build.check_checkpoint_model(latest / "critic", base, critic=True)
    return latest


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


def _shared(fn, world: World):
    """`fn()` on rank 0, its result (or its ValueError) on every rank."""
    result, error = None, None
    if world.is_main:
        try:
            result = fn()
        except ValueError as err:  # raised again on every rank, so all stop with the same message
            error = str(err)
    result, error = share((result, error))
    if error is not None:
        raise ValueError(error)
    return result


class Trainer:
    """Everything one rank holds while training."""

    def __init__(self, cfg: MoltConfig, run: RunDir, world: World, resume: bool):
        self.cfg, self.rundir, self.world = cfg, run, world
        self.log = get_logger()
        check_kernel(cfg.actor.logprob_kernel, world.device)  # before minutes of loading
        self.base = _shared(lambda: resolve_model(cfg.model, run.models), world)
        ckpt = _shared(lambda: resume_point(cfg, run, self.base, resume), world)
        random.seed(cfg.run.seed)
        np.random.seed(cfg.run.seed)
        torch.manual_seed(cfg.run.seed)
        t0 = time.perf_counter()
        self.models = self._build_models(ckpt)
        self.log.info(
            "%d rank(s) on %s; models from %s ready in %.1fs", world.size, world.device, ckpt or self.base,
            time.perf_counter() - t0,
        )  # fmt: skip
        self.parts = [p for p in (self.models.policy, self.models.critic) if p is not None]
        self.pad_id = pad_token_id(self.models.policy.model.config)
        self.step = 0
        self.saved_step: int | None = None
        self.feed = Feed(cfg, run.path, world)
        if ckpt is not None:
            rs = state.restore(world, ckpt, self.parts, cfg.run.seed)
            self.step, self.saved_step = rs["step"], rs["step"]
            self.feed.commit(rs["trained_groups"])  # a crash between publish and ack left them claimed
            self.feed.last_position = rs.get("data_position", {})
            self.models.kl_coef = rs.get("kl_coef")  # the adaptive KL controller's (None: the configured one)
            self.log.info("resumed from %s: step %d", ckpt, self.step)
        self.control = Control(run.path, world.is_main)
        self.sync = EngineSync(cfg, run.path, world)
        self.metrics = MetricsWriter(run.metrics, source="actor") if world.is_main else None
        self.refit_s: float | None = None
        self.memory = StepMemory(world.device)

    @property
    def version(self) -> int:
        return self.step

    def _build_models(self, ckpt: Path | None) -> Models:
        cfg, world = self.cfg, self.world
        if cfg.actor.offload == "optimizer" and world.device.type == "cpu":
            self.log.info("actor.offload = 'optimizer' on a CPU trainer: the optimizer state is in host memory already")
        adapter = ckpt / "policy" if ckpt and cfg.actor.lora else None  # LoRA: the base, then the adapters
        src = ckpt / "policy" if ckpt and adapter is None else self.base
        # how rows run (packing, CP) follows from the model's config and modules: read on the meta device
        docs, pack_tokens = sequence_layout(cfg, world, meta_model(src, critic=False, dtype=torch.float32,
                                                                   attn=cfg.model.attn_implementation))  # fmt: skip
        self.log.info(
            "micro-batches: %s; context parallel %d", f"packed, {pack_tokens} tokens" if pack_tokens else
            f"{cfg.actor.micro_batch_size} padded rows", cfg.actor.cp,
        )  # fmt: skip
        policy = build.load_model(src, cfg, world, "policy", documents=docs, adapter=adapter)
        moe = MoeRouting.for_policy(policy, cfg)  # replay, aux losses and routing metrics of an MoE policy
        models = Models(policy=self._trainable("policy", policy, cfg.actor.lr), pack_tokens=pack_tokens, moe=moe)
        if is_vision_model(self.base):  # pixel values from the base directory's image processor
            models.images = ImageInputs(Vision(self.base))
        if cfg.algorithm.uses_reference:
            # LoRA: the policy itself, its adapters switched off for the reference forward (step.py)
            ref = policy if cfg.actor.lora else build.load_model(self.base, cfg, world, "reference", documents=docs)
            models.reference = ref
        if cfg.algorithm.uses_critic:
            critic = build.load_model(ckpt / "critic" if ckpt else self.base, cfg, world, "critic", documents=docs)
            models.critic = self._trainable("critic", critic, cfg.actor.critic_lr)
        return models

    def _trainable(self, name: str, model, lr: float) -> state.Trainable:
        opt = build.build_optimizer(model, self.cfg.actor, lr)
        return state.Trainable(name, model, opt, build.build_scheduler(opt, self.cfg.actor, self.cfg.run.steps))

    def checkpoint(self) -> None:
        """Save the state at the current step boundary (once per step), then ack the groups it covers."""
        if self.saved_step == self.step:
            return
        t0 = time.perf_counter()
        covered = self.feed.state()
        run_state = {"version": self.version, **covered, "buffer": self.feed.stats(), "model": str(self.base),
                     "kl_coef": self.models.kl_coef}  # fmt: skip
        c = self.cfg.checkpoint
        path = state.save(
            self.world, self.rundir.checkpoints, self.step, self.parts, run_state,
            tokenizer_src=self.base, shard_bytes=c.shard_mb << 20, keep_last=c.keep_last,
            save_optimizer=c.save_optimizer,
        )  # fmt: skip
        self.feed.commit(covered["trained_groups"])
        self.saved_step = self.step
        self.log.info("checkpoint %s (%.2fs)", path.name, time.perf_counter() - t0)

    def refit(self) -> None:
        self.refit_s = self.sync.refit(self.models.policy.model, self.version)

    def serve(self, req: Requests) -> None:
        if req.checkpoint or req.stop:
            self.checkpoint()
            self.control.served(req)
        if req.refit and not req.stop:
            self.refit()

    def close(self) -> None:
        """Close what this rank opened: the refit sender (its engine connections and TCPStore), metrics."""
        self.sync.close()
        if self.metrics is not None:
            self.metrics.close()

    def run(self) -> int:
        cfg = self.cfg
        self.refit()
        while self.step < cfg.run.steps:
            t0 = time.perf_counter()
            groups, req = self.feed.fetch(cfg.actor.groups_per_step, self.version, self.control, self.sync)
            self.serve(req)
            if req.stop:
                self.log.info("stopped at step %d after a checkpoint", self.step)
                return 0
            if groups is None:
                continue
            self.train(groups, wait_s=time.perf_counter() - t0)
        if self.refit_s is None or self.step % cfg.refit.interval:
            self.refit()
        self.checkpoint()
        self.control.mark_done()
        self.log.info("training finished after %d steps", self.step)
        return 0

    def train(self, groups, wait_s: float) -> None:
        cfg = self.cfg
        staleness = staleness_histogram(groups, self.version)
        t0 = time.perf_counter()
        self.memory.start()
        metrics = train_step(groups, cfg, self.models, self.world, self.pad_id)
        step_s = time.perf_counter() - t0
        # `reward`: every finished sample the batch reports (dynamic sampling's dropped ones included);
        # `reward_trained`: the samples this step trained on.
        metrics["reward_trained"] = metrics.pop("reward")
        metrics["reward"] = finished_reward(groups)
        self.step += 1
        self.feed.record(groups)
        self.feed.heartbeat()
        self.refit_s = None
        if self.step % cfg.refit.interval == 0:
            self.refit()
        checkpoint_s = None
        if cfg.checkpoint.interval and self.step % cfg.checkpoint.interval == 0:
            t1 = time.perf_counter()
            self.checkpoint()
            checkpoint_s = time.perf_counter() - t1
        # A step's wall time is wait_s (for rollouts) + step_s (training) + refit_s + checkpoint_s.
        record = {
            "step": self.step, "version": self.version, **metrics, "staleness": staleness, "refit_s": self.refit_s,
            "step_s": step_s, "wait_s": wait_s, "checkpoint_s": checkpoint_s,
            "tokens_per_s": metrics["tokens"] / step_s, **self.feed.stats(),
            **self.memory.peaks(),  # of the whole iteration: update, refit and checkpoint when they ran
        }  # fmt: skip
        if self.metrics is not None:
            self.metrics.write(record)
        self.log.info(step_line(self.step, record))


def main(cfg: MoltConfig, run_dir: str | Path, *, resume: bool = False) -> int:
    """Train the run in `run_dir` on this rank (torchrun starts one per rank); returns the exit code.

    The shutdown is ordered: the refit sender's connections and store close, the metrics file closes,
    every rank meets at a barrier (a clean end only), then the process groups are destroyed. The
    entry point then leaves through `end_process`, past the interpreter teardown that torch's own
    threads do not survive.
    """
    run = RunDir(Path(run_dir).absolute())
    return run_rank(cfg, lambda world: Trainer(cfg, run, world, resume))
