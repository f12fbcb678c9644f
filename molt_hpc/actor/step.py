"""One training step: the step's groups → experience → reference log-probs, values, advantages, the
old policy's log-probs → micro-batched policy updates (and critic updates) aggregated over the global batch.

A step is `ppo_epochs × mini_batches` optimizer updates of the policy on `actor.groups_per_step`
groups (and `critic_epochs × mini_batches` of the critic). Each update's loss is a weighted sum over
action tokens whose denominators (tokens, samples; `algorithm.loss_agg`) are those of that mini-batch
over *all* micro-batches and ranks (`global_loss_scale`); FSDP averages gradients over ranks, so each
rank scales its loss by the world size to turn that average into the sum. With context parallelism
the ranks of a CP group share rows: the counts run over data-parallel ranks only and the scale is the
data-parallel size (`molt_hpc.parallel.context`).

When `algorithm.recompute_old` holds (`ppo_epochs > 1`, or an IS correction), one no-grad forward of
the policy over the step's batch, before its first update, gives the PPO old policy's log-probs
(`Experience.old_log_probs`); nothing else adds a forward. With `algorithm.kl_target` the KL
coefficient adapts after every step (`Models.kl_coef`, saved with the checkpoint's run state).
"""

import contextlib
from dataclasses import dataclass, field

import torch
from torch import nn

from molt_hpc.actor import lora
from molt_hpc.actor.batch import critic_values, mini_batch_rows, policy_logprobs, rows_forward
from molt_hpc.actor.clip import clip_grad_norm
from molt_hpc.actor.moe_router import MoeRouting
from molt_hpc.actor.packing import rank_micro_batches
from molt_hpc.actor.state import Trainable
from molt_hpc.actor.vision import ImageInputs
from molt_hpc.actor.world import World, gather_all
from molt_hpc.algorithm import (
    Experience,
    compute_advantages,
    experience_from_groups,
    kl_estimate,
    mismatch,
    policy_loss,
    value_loss,
)
from molt_hpc.algorithm.distill import distill_advantages, reverse_kl, teacher_rate
from molt_hpc.algorithm.kl import adaptive_kl_coef
from molt_hpc.algorithm.loss import global_loss_scale, policy_mask
from molt_hpc.config import MoltConfig
from molt_hpc.parallel.expert import clip_grad_norm as clip_grad_norm_meshes
from molt_hpc.parallel.expert import on_several_meshes
from molt_hpc.trajectory import Group

SUMMED = {"loss", "policy_loss", "value_loss"}  # already divided by the global token count
COUNTED = {"mismatch_tokens"}  # counts, summed over micro-batches and ranks
MAXED = {"ratio_max", "is_weight_max", "mismatch_abs_max"}
MINNED = {"ratio_min"}


@dataclass
class Models:
    """What a step trains and reads: the policy, the frozen reference, the critic (each optional but the policy)."""

    policy: Trainable
    reference: nn.Module | None = None
    critic: Trainable | None = None
    pack_tokens: int | None = None
    """Tokens of one packed micro-batch (`molt_hpc.actor.packing`); None: rows padded `micro_batch_size` at a time."""
    moe: MoeRouting | None = None
    """The policy's MoE routers (replay, aux losses, routing metrics); None for a dense policy."""
    images: ImageInputs | None = None
    """A vision-language policy's image inputs (`molt_hpc.actor.vision`); None for a text model."""
    kl_coef: float | None = None
    """The adaptive KL coefficient now (`algorithm.kl_target`); None: `algorithm.kl_coef` as configured."""


@dataclass
class Meter:
    """Metrics of one step's micro-batches, reduced over micro-batches and ranks. Values stay tensors
    on the device until `reduce` reads them all at once: one host sync per step, not one per metric
    and micro-batch (each would stall the host until the GPU had finished the backward)."""

    sums: dict[str, torch.Tensor | float] = field(default_factory=dict)
    weights: dict[str, float] = field(default_factory=dict)
    updates: dict[str, int] = field(default_factory=dict)

    def add(self, metrics: dict[str, torch.Tensor], tokens: int) -> None:
        if tokens == 0:  # a padding micro-batch: no data, nothing to report
            return
        for key, value in metrics.items():
            v = value.detach().double() if isinstance(value, torch.Tensor) else float(value)
            old = self.sums.get(key)
            if key in SUMMED or key in COUNTED:
                self.sums[key] = v if old is None else old + v
            elif key in MAXED:
                self.sums[key] = v if old is None else torch.maximum(torch.as_tensor(old), torch.as_tensor(v))
            elif key in MINNED:
                self.sums[key] = v if old is None else torch.minimum(torch.as_tensor(old), torch.as_tensor(v))
            else:
                self.sums[key] = v * tokens if old is None else old + v * tokens
                self.weights[key] = self.weights.get(key, 0.0) + tokens

    def update(self, key: str) -> None:
        self.updates[key] = self.updates.get(key, 0) + 1

    def _host_sums(self) -> dict[str, float]:
        keys = sorted(self.sums)
        values = [torch.as_tensor(self.sums[k], dtype=torch.float64).reshape(()) for k in keys]
        devices = {v.device for v in values}
        if len(devices) > 1:
            values = [v.cpu() for v in values]
        return dict(zip(keys, torch.stack(values).tolist(), strict=True)) if values else {}

    def reduce(self) -> dict[str, float]:
        """The step's metrics, the same on every rank (a collective)."""
        parts = gather_all((self._host_sums(), self.weights))
        out: dict[str, float] = {}
        for key in sorted({k for sums, _ in parts for k in sums}):
            values = [sums[key] for sums, _ in parts if key in sums]
            if key in MAXED:
                out[key] = max(values)
            elif key in MINNED:
                out[key] = min(values)
            elif key in COUNTED:
                out[key] = sum(values)
            elif key in SUMMED:
                kind = "value" if key == "value_loss" else "policy"
                out[key] = sum(values) / max(1, self.updates.get(kind, 1))
            else:
                weight = sum(w.get(key, 0.0) for _, w in parts)
                out[key] = sum(values) / weight if weight else 0.0
        return out


def build_experience(groups: list[Group], cfg: MoltConfig, models: Models, world: World, pad_id: int) -> Experience:
    """The step's whole batch (same on every rank) with reference log-probs, values and advantages."""
    images = models.images
    if images is not None:
        images.new_step()
    vision = images.vision.spec if images is not None else None
    exp = experience_from_groups(groups, max_len=cfg.rollout.max_total_tokens, pad_id=pad_id, vision=vision)
    rows = torch.arange(exp.sequences.shape[0])
    act, temp, shape = cfg.actor, cfg.rollout.temperature, (cfg.actor.micro_batch_size, models.pack_tokens)
    if models.reference is not None:
        ref = models.reference
        with lora.adapters_disabled(ref) if act.lora else contextlib.nullcontext():  # LoRA: the base is the reference
            exp.base_log_probs = rows_forward(
                lambda mb: policy_logprobs(ref, mb, temp, act.logprob_chunk, act.logprob_kernel, images=images)[0],
                exp,
                rows,
                *shape,
                world,
            )
    if models.critic is not None:
        critic = models.critic.model
        exp.values = rows_forward(lambda mb: critic_values(critic, mb), exp, rows, *shape, world)
    if cfg.algorithm.recompute_old(act.ppo_epochs):
        exp.old_log_probs = rows_forward(lambda mb: _old_logprobs(mb, cfg, models), exp, rows, *shape, world)
    return distilled(compute_advantages(exp, cfg.algorithm), cfg)


def distilled(exp: Experience, cfg: MoltConfig) -> Experience:
    """With `[distill]`, the advantages become the teacher's per-token signal (alone, or added to the env's);
    a batch without the teacher's log-probs is refused, never trained on a made-up signal."""
    dist = cfg.distill
    if dist is None:
        return exp
    if exp.teacher_log_probs is None:
        raise ValueError(
            "[distill] is set but the step's groups carry no teacher log-probs (put into the buffer by a run "
            "without [distill]?): resume with the config that produced them, or start a new run"
        )
    if dist.top_k and exp.teacher_top_ids is None:
        raise ValueError(
            "distill.top_k is set but the step's groups carry no teacher top tokens (put into the buffer by a run "
            "without it?): resume with the config that produced them, or start a new run"
        )
    exp.advantages = distill_advantages(exp.advantages, exp.teacher_log_probs, exp.action_log_probs, exp.action_mask,
                                        dist.combine, dist.weight, dist.whiten, cfg.algorithm.adv_eps)  # fmt: skip
    return exp


def _old_logprobs(mb: Experience, cfg: MoltConfig, models: Models) -> torch.Tensor:
    """The policy's log-probs of one micro-batch before any update (the PPO old policy), routed as in training."""
    act = cfg.actor
    with models.moe.micro_batch(mb) if models.moe else contextlib.nullcontext():
        return policy_logprobs(
            models.policy.model, mb, cfg.rollout.temperature, act.logprob_chunk, act.logprob_kernel,
            images=models.images,
        )[0]  # fmt: skip


def optimizer_step(part: Trainable, max_norm: float) -> float:
    """Clip the global gradient norm, step, zero the gradients; returns the norm before clipping."""
    params = [p for p in part.model.parameters() if p.requires_grad]
    if on_several_meshes(params):  # expert parallelism: experts and the rest are on two meshes
        norm = float(clip_grad_norm_meshes(params, max_norm))
    else:
        norm = clip_grad_norm(params, max_norm)
    part.optimizer.step()
    part.optimizer.zero_grad(set_to_none=True)
    return norm


def train_mask(mb: Experience, cfg: MoltConfig, n_samples: int) -> torch.Tensor:
    """The policy's training tokens of a micro-batch (`algorithm.is_correction = "mask"` drops some)."""
    return policy_mask(mb.action_mask, mb.action_log_probs, cfg.algorithm, old_log_probs=mb.old_log_probs,
                       seq_index=mb.seq_index, n_samples=n_samples)  # fmt: skip


def _updates(exp: Experience, cfg: MoltConfig, world: World, epochs: int, pack_tokens: int | None, policy: bool):
    """(micro-batches, global `LossScale`) of every update of `epochs` passes over the mini-batches; the
    policy's counts its training tokens and samples, the critic's all action tokens."""
    length = cfg.algorithm.loss_agg_length or cfg.rollout.max_new_tokens
    for epoch in range(epochs):
        for rows in mini_batch_rows(exp, cfg.actor.mini_batches):
            mbs = [mb.batch for mb in rank_micro_batches(exp, rows, cfg.actor.micro_batch_size, pack_tokens, world)]
            masks = [train_mask(mb, cfg, exp.num_samples) if policy else mb.action_mask for mb in mbs]
            scale = global_loss_scale(masks, [mb.seq_index for mb in mbs], length, group=world.dp_group)
            if scale.tokens == 0:  # every rank agrees (a global count): nothing to train in this mini-batch
                continue
            yield epoch, mbs, scale


def update_policy(
    exp: Experience, cfg: MoltConfig, models: Models, world: World, meter: Meter, version: int | None = None
) -> list[float]:
    """The policy's updates of this step; returns the gradient norm of each. With `version` (the weights'
    policy version), the mismatch observatory reads the trainer's log-probs before any update."""
    part, alg, act = models.policy, cfg.algorithm, cfg.actor
    norms = []
    for epoch, mbs, scale in _updates(exp, cfg, world, act.ppo_epochs, models.pack_tokens, policy=True):
        before_update = not norms  # the first update: the weights are still those of `version`
        for host_mb in mbs:
            mb = host_mb.to(world.device)
            top: list[torch.Tensor] | None = [] if cfg.distill is not None and cfg.distill.top_k else None
            with models.moe.micro_batch(mb) if models.moe else contextlib.nullcontext():
                logp, ent = policy_logprobs(
                    part.model, mb, cfg.rollout.temperature, act.logprob_chunk, act.logprob_kernel,
                    images=models.images, top_kl=top,
                )  # fmt: skip
                loss, metrics = policy_loss(
                    logp, mb.action_log_probs, mb.advantages, mb.action_mask, alg, scale,
                    seq_index=mb.seq_index, n_samples=exp.num_samples, base_log_probs=mb.base_log_probs, entropy=ent,
                    old_log_probs=mb.old_log_probs,
                )  # fmt: skip
                if top:  # distill.top_k: the forward KL on the teacher's top tokens, a global token mean too
                    loss, metrics = _with_top_kl(loss, metrics, top[0], mb.action_mask, scale.tokens, cfg)
                if models.moe:  # MoE aux losses, weighted by the micro-batch's share of the global tokens
                    loss = loss + models.moe.aux_loss(int(mb.action_mask.sum()) / scale.tokens)
                (loss * world.dp_size).backward()
            meter.add({**metrics, "loss": loss.detach()}, _reported_tokens(host_mb, world))
            if version is not None and world.cp_rank == 0:
                _observe_mismatch(meter, mb, logp if before_update else None, epoch, version, alg.is_threshold)
        norms.append(optimizer_step(part, act.grad_clip))
        meter.update("policy")
    return norms


def _with_top_kl(loss, metrics: dict, kl: torch.Tensor, mask: torch.Tensor, tokens: int, cfg: MoltConfig):
    """The policy loss plus `distill.top_k_weight ·` the top-k forward KL summed over the micro-batch's action
    tokens and divided by the global token count; `distill/topk_kl` its mean per action token."""
    assert cfg.distill is not None
    total = (kl * mask).sum()
    mean = total.detach() / mask.sum().clamp(min=1)
    return loss + cfg.distill.top_k_weight * total / tokens, {**metrics, "distill/topk_kl": mean}


def _observe_mismatch(meter: Meter, mb: Experience, logp, epoch: int, version: int, threshold: float) -> None:
    """The mismatch observatory's parts of one micro-batch, from log-probs of the weights of `version`: the
    recomputed old policy's over the first epoch, or the live ones (`logp`) before the first update."""
    before = mb.old_log_probs if mb.old_log_probs is not None and epoch == 0 else logp
    if before is None:
        return
    for values, tokens in mismatch.observe(
        before, mb.action_log_probs, mb.action_mask, mb.versions, version, mb.seq_index, threshold
    ):
        meter.add(values, tokens)


def update_critic(exp: Experience, cfg: MoltConfig, models: Models, world: World, meter: Meter) -> list[float]:
    """The critic's updates of this step (clipped value loss against the GAE returns)."""
    part, alg = models.critic, cfg.algorithm
    assert part is not None and exp.values is not None and exp.returns is not None
    norms = []
    for _epoch, mbs, scale in _updates(exp, cfg, world, cfg.actor.critic_epochs, models.pack_tokens, policy=False):
        for host_mb in mbs:
            mb = host_mb.to(world.device)
            values = critic_values(part.model, mb)
            loss, metrics = value_loss(values, mb.values, mb.returns, mb.action_mask, scale.tokens, alg.value_clip)
            (loss * alg.value_coef * world.dp_size).backward()
            meter.add({**metrics, "value_loss": loss.detach()}, _reported_tokens(host_mb, world))
        norms.append(optimizer_step(part, cfg.actor.grad_clip))
        meter.update("value")
    return norms


def _reported_tokens(mb: Experience, world: World) -> int:
    """Action tokens a micro-batch's metrics weigh (read from its host copy: no device sync); 0 (not
    reported) on all but one rank of a CP group, whose ranks computed the same loss."""
    return int(mb.action_mask.sum()) if world.cp_rank == 0 else 0


def train_step(
    groups: list[Group], cfg: MoltConfig, models: Models, world: World, pad_id: int, version: int | None = None
) -> dict[str, float]:
    """One training step on `groups` (the same on every rank); returns its metrics (the same on every rank).
    `version` is the policy version of the weights the step starts from (the mismatch observatory's)."""
    if models.kl_coef is not None:  # the adaptive controller's coefficient replaces the configured one
        cfg = cfg.model_copy(update={"algorithm": cfg.algorithm.model_copy(update={"kl_coef": models.kl_coef})})
    exp = build_experience(groups, cfg, models, world, pad_id)
    meter = Meter()
    norms = update_policy(exp, cfg, models, world, meter, version)
    critic_norms = update_critic(exp, cfg, models, world, meter) if models.critic is not None else []
    out = mismatch.finish(meter.reduce())
    out["updates"] = len(norms)
    if norms:
        out["grad_norm"] = sum(norms) / len(norms)
    if critic_norms:
        out["critic_grad_norm"] = sum(critic_norms) / len(critic_norms)
    for part in (models.policy, models.critic):
        if part is not None:
            out["lr" if part is models.policy else "critic_lr"] = part.optimizer.param_groups[0]["lr"]
            part.scheduler.step()
    out.update(batch_metrics(exp))
    if exp.teacher_log_probs is not None:
        out["distill/reverse_kl"] = reverse_kl(exp.teacher_log_probs, exp.action_log_probs, exp.action_mask)
        out["distill/teacher_tokens_per_s"] = teacher_rate(groups)
    if models.moe:
        out.update(models.moe.step_metrics(exp))
    if "kl" not in out and exp.base_log_probs is not None:  # the KL went into the reward: report the rollout's
        kl = kl_estimate(exp.action_log_probs, exp.base_log_probs, cfg.algorithm.kl_estimator)
        out["kl"] = float(kl[exp.action_mask].mean()) if exp.num_action_tokens else 0.0
    alg = cfg.algorithm
    if alg.kl_target is not None and "kl" in out:
        out["kl_coef"] = alg.kl_coef
        models.kl_coef = adaptive_kl_coef(alg.kl_coef, out["kl"], alg.kl_target, alg.kl_horizon, exp.num_samples)
    return out


def batch_metrics(exp: Experience) -> dict[str, float]:
    lengths = exp.action_mask.sum(dim=1).float()
    return {
        "reward": float(exp.reward.mean()),
        "reward_std": float(exp.reward.std()) if exp.num_samples > 1 else 0.0,
        "samples": exp.num_samples,
        "action_tokens": exp.num_action_tokens,
        "tokens": int(exp.attention_mask.sum()),
        "response_len": float(lengths.mean()),
        "truncated_samples": exp.stats.get("truncated_samples", 0),
        **{k: exp.stats[k] for k in ("vlm_truncation", "media_token") if k in exp.stats},
    }
