"""Speed of one RL training step, predicted from the model's shape, the config and the hardware.

Each pool runs on the speed profile of its device (`plan.cuda` or `plan.cpu`, `SpeedProfile`):

- rollout: a decode step of one engine replica with `r` rows in flight at mean context `c` reads its
  weights (the routed experts the rows touch) and `r·c` tokens of KV cache, and runs `2·N_mm·r`
  FLOPs plus attention; it takes `max(bytes / (bandwidth · decode_efficiency), FLOPs / matmul rate) +
  the engine's per-step overhead` (the built-in engine's: `builtin_step_ms + r · builtin_row_ms`). Requests
  in flight are the rollout's `min(groups_in_flight, (max_staleness + 1) · groups_per_step) · n_samples`
  (the second term over the fraction of groups accepted under `rollout.admission = "kept_share"`); a
  request decodes for `response` of the `tail + w` steps its group holds its admission (`tail`: the
  group's longest response, `w`: half of `engines.prefill_interval` for the built-in engine's prefill
  call, 0 for vLLM), so the rows are that share of them, over the replicas, at most what one replica
  holds (`max_batch`, or vLLM's 256 sequences and its KV cache). A step's worth of samples (over the
  fraction of groups accepted, when dynamic sampling drops some) takes `samples / (replicas · r)` rounds
  of `response` decode steps; prefill runs the prompts against
  compute (at the trainer's MFU class), and the built-in engine adds the host time of its prefill calls
  (`builtin_prefill_layer_ms` a layer; a call every `engines.prefill_interval` decode steps, at least
  one per round of rows).
- train: `(6 + 2 with activation checkpointing)·N_mm` FLOPs per token per epoch, attention, the
  log-prob head over the response positions (`8·V·h` fused: forward, its recompute, two gradients),
  the reference forward (`2·N_mm`), a critic (its forward and training), over `ranks × matmul rate ×
  MFU` of the hidden size's class; plus `train_micro_batch_ms` per micro-batch and per update,
  `train_sample_ms` per sample a data-parallel rank trains in each epoch, and
  offloaded state over the host link each update.
- refit: `plan.refit` (bytes over the links and 2 ms a bucket; for built-in engines on the GPU of a
  trainer of one rank, its parameters read in place: a copy at `memory_gb_per_s`) plus `refit_fixed_ms`
  (`vllm_refit_fixed_ms` for vLLM engines), every `refit.interval` steps.

Bound: with `buffer.max_staleness ≥ 1` on separate devices the engines decode while the trainer
trains, so a step takes `max(rollout, train) + refit`; synchronous (staleness 0), `rollout + train + refit`.
Asynchronous with the pools on one device (a shared GPU, or both on the CPU) the engine decodes beside the
training too, but neither at its own speed: the engine at `r = shared_decode_rate` of it, the trainer's step
`g = shared_train_slowdown` times longer (both measured by `plan --calibrate` on a GPU; by default 0 and 1,
the in-sequence price). With `R` and `T` the rollout and the train time alone, the engine does `r·g·T` of
its `R` beside the training. When that is not all of it (`R ≥ r·g·T`) the engine bounds the step:
`R + g·T·(1 − r) + refit`, the trainer's part `g·T`. Otherwise the engine finishes beside the training
after `R / r` and the trainer goes on alone: `T + (R / r)·(1 − 1/g) + refit`, all of it the trainer's.
`r = 0` is the in-sequence price, `r = 1, g = 1` the overlap of two devices.
"""

import math
from dataclasses import dataclass

from molt_hpc.config import MoltConfig
from molt_hpc.config.infra import SpeedProfile
from molt_hpc.plan.arch import Arch
from molt_hpc.plan.shape import shape_of

VLLM_MAX_SEQS = 256
"""vLLM's default `max_num_seqs`: sequences one replica decodes at once."""


def profile(cfg: MoltConfig, device: str) -> SpeedProfile:
    return cfg.plan.cpu if device == "cpu" else cfg.plan.cuda


def mfu(p: SpeedProfile, hidden: int) -> float:
    """The training MFU of the hidden size's shape class."""
    return p.mfu_small if hidden < 2048 else p.mfu_medium if hidden < 6144 else p.mfu_large


def matmul_params(arch: Arch) -> float:
    """Parameters one token multiplies through, LM head included, input embedding not: a MoE token
    passes `top_k` of its block's experts."""
    experts = arch.expert_params * (arch.top_k / arch.experts) if arch.is_moe else 0.0
    embedding = 0 if arch.tied else arch.vocab * arch.hidden
    return arch.params - arch.expert_params + experts - embedding


def attention_flops(arch: Arch, context: float) -> float:
    """Forward FLOPs of one token's attention over `context` earlier tokens (scores and values)."""
    return 4.0 * arch.layers * arch.heads * arch.head_dim * context


@dataclass(frozen=True)
class Workload:
    """One training step's samples and their lengths."""

    samples: int
    prompt: float
    response: float
    accepted: float = 1.0
    """Fraction of finished groups the step trains on (dynamic sampling drops the rest: they were
    generated all the same)."""
    tail: float | None = None
    """The longest response of a group (a group holds its admission until it ends); None: `response`."""

    @property
    def generated(self) -> float:
        """Tokens the engines generate for one step, dropped groups included."""
        return self.samples * self.response / self.accepted

    @property
    def trained_generated(self) -> float:
        """Generated tokens the step trains on: where the log-prob head runs."""
        return self.samples * self.response

    @property
    def trained(self) -> float:
        return self.samples * (self.prompt + self.response)


def workload(
    cfg: MoltConfig,
    prompt: float | None = None,
    response: float | None = None,
    accepted: float = 1.0,
    tail: float | None = None,
) -> Workload:
    """The step's samples, at full length and every group accepted unless measured numbers are given."""
    ro = cfg.rollout
    full_prompt = min(cfg.data.max_prompt_tokens, ro.max_total_tokens - ro.max_new_tokens)
    return Workload(cfg.actor.groups_per_step * ro.n_samples, full_prompt if prompt is None else prompt,
                    ro.max_new_tokens if response is None else response, accepted, tail)  # fmt: skip


@dataclass(frozen=True)
class Rollout:
    rows: int
    """Rows one engine replica decodes at once."""
    decode_step_s: float
    decode_s: float
    prefill_s: float
    bound: str
    """What bounds a decode step: `memory`, `compute` or `overhead`."""
    groups: float = 0.0
    """Groups the rollout holds in flight (`rollout.groups_in_flight`, or fewer where admission bounds them)."""

    @property
    def seconds(self) -> float:
        return self.decode_s + self.prefill_s


def decode_step(p: SpeedProfile, weight_bytes: float, kv_bytes: float, flops: float, overhead_ms: float):
    """(seconds, bound) of one decode step."""
    memory = (weight_bytes + kv_bytes) / (p.memory_gb_per_s * 1e9 * p.decode_efficiency)
    compute = flops / (p.matmul_tflops * 1e12)
    overhead = overhead_ms / 1e3
    parts = {"memory": memory, "compute": compute, "overhead": overhead}
    return max(memory, compute) + overhead, max(parts, key=parts.get)


def occupancy(w: Workload, eng) -> float:
    """The share of its time in flight a request decodes: it waits for the built-in engine's next prefill call
    (half of `engines.prefill_interval` decode steps on average), decodes its own `response` tokens, and its
    group holds its admission until the group's longest response (`tail`) ends."""
    wait = eng.prefill_interval / 2 if eng.kind == "builtin" else 0.0
    tail = w.response if w.tail is None else max(w.tail, w.response)
    return w.response / (tail + wait) if w.response > 0 else 1.0


def rollout_time(arch: Arch, cfg: MoltConfig, plan, w: Workload) -> Rollout:
    """Seconds the engine pool takes to generate one step's samples (`plan`: the memory plan)."""
    eng, ro, mem = cfg.engines, cfg.rollout, plan.engines
    p = profile(cfg, plan.placement.engine_device)
    replicas = max(1, plan.placement.engines * mem.replicas)
    tp = eng.tensor_parallel if eng.kind == "vllm" else 1
    context = w.prompt + w.response / 2
    bound = (cfg.buffer.max_staleness + 1) * cfg.actor.groups_per_step
    bound = bound / w.accepted if ro.admission == "kept_share" else bound  # in flight at the kept share each
    groups = min(ro.groups_in_flight, bound)
    in_flight = groups * ro.n_samples * occupancy(w, eng)
    cap = eng.max_batch if eng.kind == "builtin" else min(VLLM_MAX_SEQS, max(1, int(mem.kv_tokens // context)))
    rows = max(1, min(math.ceil(in_flight / replicas), cap))
    b = 4 if cfg.model.dtype == "float32" else 2
    dense = arch.params - arch.expert_params - (0 if arch.tied else arch.vocab * arch.hidden)
    touched = 1 - (1 - arch.top_k / arch.experts) ** rows if arch.is_moe else 0.0
    weights = b * (dense / tp + arch.expert_params * touched / (tp * mem.replicas))
    kv = rows * context * arch.kv_bytes_per_token(tp, b)
    flops = rows * (2 * matmul_params(arch) + attention_flops(arch, context)) / tp
    overhead = p.builtin_step_ms + rows * p.builtin_row_ms if eng.kind == "builtin" else p.vllm_step_ms
    step_s, bound = decode_step(p, weights, kv, flops, overhead)
    rounds = w.samples / w.accepted / (replicas * rows)
    prefill_flops = w.samples / w.accepted * w.prompt * (2 * matmul_params(arch) + attention_flops(arch, w.prompt / 2))
    prefill = prefill_flops / (replicas * tp * p.matmul_tflops * 1e12 * mfu(p, arch.hidden))
    if eng.kind == "builtin":  # a prefill every `prefill_interval` decode steps, at least one per batch of rows
        calls = w.samples / w.accepted / (replicas * rows) * max(1.0, w.response / eng.prefill_interval)
        prefill += calls * arch.layers * p.builtin_prefill_layer_ms / 1e3
    return Rollout(rows, step_s, rounds * w.response * step_s, prefill, bound, groups)


@dataclass(frozen=True)
class Train:
    flops: float
    compute_s: float
    overhead_s: float
    offload_s: float

    @property
    def seconds(self) -> float:
        return self.compute_s + self.overhead_s + self.offload_s


def train_flops(arch: Arch, cfg: MoltConfig, w: Workload) -> float:
    """FLOPs of one training step over all ranks."""
    act, alg = cfg.actor, cfg.algorithm
    head = arch.vocab * arch.hidden
    body = matmul_params(arch) - head  # the decoder blocks (and a MoE token's experts)
    per_token = 2 * body + attention_flops(arch, (w.prompt + w.response) / 2)
    passes = 3 + (1 if act.activation_checkpointing else 0)  # forward, backward (2x), recompute
    head_passes = 4 if arch.fused_head else 3  # forward, (recompute,) grad hidden, grad head
    policy = act.ppo_epochs * (passes * per_token * w.trained + head_passes * 2 * head * w.trained_generated)
    reference = (per_token * w.trained + 2 * head * w.trained_generated) if alg.uses_reference else 0.0
    critic = (1 + act.ppo_epochs * passes) * per_token * w.trained if alg.uses_critic else 0.0
    return policy + reference + critic


def train_time(arch: Arch, cfg: MoltConfig, plan, w: Workload) -> Train:
    act, where = cfg.actor, plan.placement
    p = profile(cfg, where.actor_device)
    ranks = where.actor_ranks
    shape = shape_of(cfg, ranks, where.actor_device, arch)
    flops = train_flops(arch, cfg, w)
    compute = flops / (ranks * p.matmul_tflops * 1e12 * mfu(p, arch.hidden))
    updates = act.ppo_epochs * act.mini_batches
    overhead = updates * (shape.micro_batches + 1) * p.train_micro_batch_ms / 1e3
    overhead += act.ppo_epochs * math.ceil(w.samples / max(1, ranks // act.cp)) * p.train_sample_ms / 1e3
    moved = sum(plan.trainer.host.values())  # bytes each rank keeps on the host: to the GPU and back per update
    offload = updates * 2 * moved / (p.host_link_gb_per_s * 1e9)
    return Train(flops, compute, overhead, offload)


def shared_device(rollout: float, train: float, rate: float, slowdown: float) -> tuple[float, float]:
    """(seconds of rollout and training together, the trainer's part of them) of an asynchronous step on one
    device shared by both pools: the engine at `rate` of its speed beside the training, the training
    `slowdown` times longer beside the decoding (the module's docstring); `rate` 0: in sequence."""
    if rate <= 0.0:
        return rollout + train, train
    beside = slowdown * train
    if rollout >= rate * beside:  # the engine is still decoding when the trainer finishes: it bounds the step
        return rollout + beside * (1.0 - rate), beside
    together = rollout / rate  # the engine's samples are done beside the training, which goes on alone
    step = train + together * (1.0 - 1.0 / slowdown)
    return step, step


@dataclass(frozen=True)
class Speed:
    """One training step's predicted parts, the bound and the throughputs."""

    workload: Workload
    rollout: Rollout
    train: Train
    refit_s: float
    overlap: bool
    """The engines generate while the trainer trains (async, separate devices)."""
    shared: tuple[float, float] | None = None
    """(`shared_decode_rate`, `shared_train_slowdown`) where an async run's pools share one device; None
    where they do not."""

    def _together(self) -> tuple[float, float]:
        """(rollout and training together, the trainer's part of them)."""
        r, t = self.rollout.seconds, self.train.seconds
        if self.shared is not None:
            return shared_device(r, t, *self.shared)
        return (max(r, t) if self.overlap else r + t), t

    @property
    def step_s(self) -> float:
        return self._together()[0] + self.refit_s

    @property
    def train_wall_s(self) -> float:
        """The trainer's step as a run measures it: beside the engine's decoding on a shared device."""
        return self._together()[1]

    @property
    def wait_s(self) -> float:
        """The trainer's wait for rollouts: the step less its training and refit (0 when the step is theirs alone:
        the subtraction's rounding would otherwise print as "-0 ms")."""
        return max(0.0, self.step_s - self.train_wall_s - self.refit_s)

    @property
    def bound(self) -> str:
        parts = {"rollout": self.rollout.seconds, "train": self.train.seconds, "refit": self.refit_s}
        return max(parts, key=parts.get)

    @property
    def rollout_tokens_per_s(self) -> float:
        return self.workload.generated / self.rollout.seconds

    @property
    def delivered_tokens_per_s(self) -> float:
        """Generated tokens per second of wall time: the engines' rate, or less when the trainer bounds."""
        return self.workload.generated / self.step_s

    @property
    def trained_tokens_per_s(self) -> float:
        return self.workload.trained / self.step_s


def refit_time(cfg: MoltConfig, plan) -> float:
    """Seconds of refit per step: the plan's refit (links and buckets, or a copy in place) and the engine
    kind's fixed cost, every interval."""
    p = profile(cfg, plan.placement.actor_device)
    fixed = p.vllm_refit_fixed_ms if cfg.engines.kind == "vllm" else p.refit_fixed_ms
    return (plan.refit.seconds + fixed / 1e3) / max(1, cfg.refit.interval)


def predict(
    plan,
    prompt: float | None = None,
    response: float | None = None,
    accepted: float = 1.0,
    tail: float | None = None,
) -> Speed:
    """The speed of `plan`'s config; lengths at full and every group accepted unless measured ones are given."""
    cfg, arch, where = plan.cfg, plan.arch, plan.placement
    w = workload(cfg, prompt, response, accepted, tail)
    one_device = where.shared_gpu or (where.actor_device == where.engine_device == "cpu")
    overlap = cfg.buffer.max_staleness >= 1 and not one_device
    p = profile(cfg, where.engine_device)
    shared = (p.shared_decode_rate, p.shared_train_slowdown) if cfg.buffer.max_staleness >= 1 and one_device else None
    rollout, train = rollout_time(arch, cfg, plan, w), train_time(arch, cfg, plan, w)
    return Speed(w, rollout, train, refit_time(cfg, plan), overlap, shared)
