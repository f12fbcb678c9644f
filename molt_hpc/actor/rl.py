"""RL's task in the trainer's loop (`trainer.Trainer`): groups from the replay buffer, one RL step, refits.

It owns what only RL has: the policy with its frozen reference and critic (`step.Models`), the replay
buffer's side of the trainer (`feed.Feed`: claims, shares, acks after the checkpoint that covers the
groups), the engines' weights (`sync.EngineSync`: a refit before the first step, every `refit.interval`
steps, when the engines change, and at the end unless the last step just refitted) and the step's
memory peaks (`memory.StepMemory`, over the update, the refit and the checkpoint).
"""

from pathlib import Path
from typing import Any

import torch

from molt_hpc.actor import build, state
from molt_hpc.actor.control import Control, Requests
from molt_hpc.actor.feed import Feed, staleness_histogram
from molt_hpc.actor.memory import StepMemory
from molt_hpc.actor.moe_router import MoeRouting
from molt_hpc.actor.packing import sequence_layout
from molt_hpc.actor.step import Models, train_step
from molt_hpc.actor.sync import EngineSync
from molt_hpc.actor.task import Task
from molt_hpc.actor.vision import ImageInputs
from molt_hpc.actor.world import World
from molt_hpc.config import MoltConfig
from molt_hpc.log import get_logger
from molt_hpc.models import pad_token_id
from molt_hpc.models.sharded import meta_model
from molt_hpc.rundir import RunDir
from molt_hpc.trajectory import Group, finished_reward
from molt_hpc.vision.processor import Vision, is_vision_model


def resume_point(cfg: MoltConfig, run: RunDir, base: Path, required: bool) -> Path | None:
    """The verified checkpoint to resume from, per `checkpoint.resume` (rank 0)."""
    latest = state.latest_to_resume(cfg, run, required)
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


def build_models(cfg: MoltConfig, world: World, base: Path, ckpt: Path | None) -> Models:
    """The policy (from `ckpt` when resuming, else `base`), its reference and critic when the algorithm
    uses them, and how their rows run (packing, CP, MoE routing, image inputs)."""
    log = get_logger()
    if cfg.actor.offload == "optimizer" and world.device.type == "cpu":
        log.info("actor.offload = 'optimizer' on a CPU trainer: the optimizer state is in host memory already")
    adapter = ckpt / "policy" if ckpt and cfg.actor.lora else None  # LoRA: the base, then the adapters
    src = ckpt / "policy" if ckpt and adapter is None else base
    # how rows run (packing, CP) follows from the model's config and modules: read on the meta device
    docs, pack_tokens = sequence_layout(cfg, world, meta_model(src, critic=False, dtype=torch.float32,
                                                               attn=cfg.model.attn_implementation))  # fmt: skip
    log.info(
        "micro-batches: %s; context parallel %d", f"packed, {pack_tokens} tokens" if pack_tokens else
        f"{cfg.actor.micro_batch_size} padded rows", cfg.actor.cp,
    )  # fmt: skip
    policy = build.load_model(src, cfg, world, "policy", documents=docs, adapter=adapter)
    moe = MoeRouting.for_policy(policy, cfg)  # replay, aux losses and routing metrics of an MoE policy
    models = Models(policy=build.trainable("policy", policy, cfg, cfg.actor.lr), pack_tokens=pack_tokens, moe=moe)
    if is_vision_model(base):  # pixel values from the base directory's image processor
        models.images = ImageInputs(Vision(base))
    if cfg.algorithm.uses_reference:
        # LoRA: the policy itself, its adapters switched off for the reference forward (step.py)
        models.reference = policy if cfg.actor.lora else build.load_model(base, cfg, world, "reference", documents=docs)
    if cfg.algorithm.uses_critic:
        critic = build.load_model(ckpt / "critic" if ckpt else base, cfg, world, "critic", documents=docs)
        models.critic = build.trainable("critic", critic, cfg, cfg.actor.critic_lr)
    return models


class RlTask(Task):
    """RL's models, the buffer, the engines' refits and the step's memory peaks on one rank."""

    def __init__(self, cfg: MoltConfig, run: RunDir, world: World):
        self.cfg, self.rundir, self.world = cfg, run, world
        self.models: Models | None = None
        self.feed: Feed | None = None
        self.sync: EngineSync | None = None
        self.pad_id = 0
        self.refit_s: float | None = None
        self.memory = StepMemory(world.device)
        self.version: int | None = None
        """The policy version the batch being trained was fetched for."""

    def resume_point(self, run: RunDir, base: Path, required: bool) -> Path | None:
        return resume_point(self.cfg, run, base, required)

    def build(self, base: Path, ckpt: Path | None) -> list[state.Trainable]:
        self.models = build_models(self.cfg, self.world, base, ckpt)
        self.pad_id = pad_token_id(self.models.policy.model.config)
        self.feed = Feed(self.cfg, self.rundir.path, self.world)
        self.sync = EngineSync(self.cfg, self.rundir.path, self.world)
        return [p for p in (self.models.policy, self.models.critic) if p is not None]

    def restore(self, run_state: dict[str, Any]) -> None:
        assert self.feed is not None
        self.feed.commit(run_state["trained_groups"])  # a crash between publish and ack left them claimed
        self.feed.last_position = run_state.get("data_position", {})
        assert self.models is not None
        self.models.kl_coef = run_state.get("kl_coef")  # the adaptive KL controller's (None: the configured one)

    def run_state(self) -> dict[str, Any]:
        assert self.feed is not None and self.models is not None
        return {**self.feed.state(), "buffer": self.feed.stats(), "kl_coef": self.models.kl_coef}

    def saved(self, run_state: dict[str, Any]) -> None:
        assert self.feed is not None
        self.feed.commit(run_state["trained_groups"])

    def next_batch(self, version: int, control: Control) -> tuple[list[Group] | None, Requests]:
        assert self.feed is not None and self.sync is not None
        self.version = version  # the weights the next step starts from (the mismatch observatory's)
        return self.feed.fetch(self.cfg.actor.groups_per_step, version, control, self.sync)

    def refit(self, version: int) -> None:
        assert self.models is not None and self.sync is not None
        self.refit_s = self.sync.refit(self.models.policy.model, version)

    def train(self, groups: list[Group]) -> dict[str, Any]:
        assert self.models is not None
        self.memory.start()
        metrics = train_step(groups, self.cfg, self.models, self.world, self.pad_id, version=self.version)
        # `reward`: every finished sample the batch reports (dynamic sampling's dropped ones included);
        # `reward_trained`: the samples this step trained on.
        metrics["reward_trained"] = metrics.pop("reward")
        metrics["reward"] = finished_reward(groups)
        return metrics

    def after_step(self, step: int, groups: list[Group]) -> dict[str, Any]:
        assert self.feed is not None
        staleness = staleness_histogram(groups, step - 1)  # against the version the step trained from
        self.feed.record(groups)
        self.feed.heartbeat()
        self.refit_s = None
        if step % self.cfg.refit.interval == 0:
            self.refit(step)
        return {"staleness": staleness, "refit_s": self.refit_s}

    def step_end(self, wait_s: float, checkpoint_s: float | None) -> dict[str, Any]:
        # A step's wall time is wait_s (for rollouts) + step_s (training) + refit_s + checkpoint_s; the memory
        # peaks are the whole iteration's: update, refit and checkpoint when they ran.
        assert self.feed is not None
        return {"wait_s": wait_s, "checkpoint_s": checkpoint_s, **self.feed.stats(), **self.memory.peaks()}

    def serve(self, req: Requests, version: int) -> None:
        if req.refit and not req.stop:
            self.refit(version)

    def start(self, step: int) -> None:
        self.refit(step)

    def finish(self, step: int) -> None:
        if self.refit_s is None or step % self.cfg.refit.interval:
            self.refit(step)

    def close(self) -> None:
        """Close the refit sender (its engine connections and TCPStore)."""
        if self.sync is not None:
            self.sync.close()
