"""Config sections for the trainer side: the RL algorithm, the actor pool and checkpoints."""

from typing import Literal

from pydantic import Field, NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt, model_validator

from molt_hpc.config.base import Section

AdvantageKind = Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae"]
PolicyLossKind = Literal["ppo", "gspo", "cispo"]
LossAggKind = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
KLEstimatorKind = Literal["k1", "k2", "k3", "abs", "mse"]
WHITENED_BY_DEFAULT = ("reinforce_pp", "reinforce_pp_baseline", "gae")
"""Estimators whose papers normalise the advantages over the batch's action tokens."""


class AlgorithmConfig(Section):
    """Steps 4-7 of the RL loop: advantages, policy loss, KL, entropy, value loss."""

    advantage: AdvantageKind = "grpo"
    """Advantage estimator. `grpo`: group mean/std; `dr_grpo`: group mean, no std, no length
    normalisation; `rloo`: leave-one-out baseline; `reinforce_pp`: token returns with KL penalty;
    `reinforce_pp_baseline`: the same with the group-mean reward as baseline; `gae`: generalised
    advantage estimation with a critic. See `whiten_advantages` for the batch normalisation."""
    whiten_advantages: bool | None = None
    """Normalise the advantages over all action tokens of the step's batch, `(A - mean) / (std +
    adv_eps)` (masked mean, Bessel std). Unset: on for `reinforce_pp`, `reinforce_pp_baseline` and
    `gae` (as their papers and the reference PPO implementations do), off for `grpo`, `dr_grpo` and
    `rloo` (already normalised within each group; whitening Dr.GRPO would bring back the std it removes)."""
    policy_loss: PolicyLossKind = "ppo"
    """Policy loss: PPO-clip on the token ratio, GSPO (sequence-level ratio) or CISPO (clipped IS
    weight times the log-prob, gradient through every token)."""
    loss_agg: LossAggKind | None = None
    """How per-token losses become the step's loss, over the whole optimizer step (all micro-batches
    and ranks): `token-mean` (sum / action tokens), `seq-mean-token-sum` (each sample's sum, averaged
    over samples), `seq-mean-token-mean` (each sample's mean, averaged over samples: every sample weighs
    the same whatever its length), `seq-mean-token-sum-norm` (sum / (samples x `loss_agg_length`),
    Dr.GRPO's constant normaliser). Unset: `seq-mean-token-mean` for GSPO (its paper), else `token-mean`."""
    loss_agg_length: PositiveInt | None = None
    """The constant length of `seq-mean-token-sum-norm`; unset: `rollout.max_new_tokens` (Dr.GRPO's
    generation budget)."""
    eps_low: float = Field(0.2, gt=0.0, lt=1.0)
    """Lower clip: the ratio is clipped at 1 - eps_low."""
    eps_high: PositiveFloat = 0.28
    """Upper clip: the ratio is clipped at 1 + eps_high (clip-higher when above eps_low)."""
    dual_clip: float | None = Field(None, gt=1.0)
    """Dual-clip bound c > 1 for negative advantages (the loss is at most c·|A|, 3.0 is usual);
    unset disables it."""
    cispo_eps_low: float | None = Field(None, gt=0.0, lt=1.0)
    """CISPO only: also clip its IS weight from below at 1 - cispo_eps_low. Unset: no lower clip (the
    MiniMax-M1 setting, whose lower bound is effectively off)."""
    old_log_probs: Literal["auto", "engine", "recompute"] = "auto"
    """The "old" policy of the loss's ratio `r = p / p_old`. `engine`: the engine's log-probs of the
    sampled tokens; `recompute`: the trainer's own log-probs under the weights that start the step,
    one no-grad forward over the step's batch before its first update (the PPO old policy; the
    engine's then only enter `is_correction`). `auto`: `recompute` when `actor.ppo_epochs > 1` or
    `is_correction` is set, else `engine`."""
    is_correction: Literal["none", "truncate", "mask"] = "none"
    """Off-policy correction of the trainer-engine gap (decoupled PPO / truncated IS): a detached factor
    from `w = p_old / p_engine` (the recomputed old policy over the engine's), separate from the loss's
    own ratio. `truncate` multiplies each token's loss by `min(w, is_threshold)`; `mask` drops the
    tokens (or samples) with `w > is_threshold` from the batch, out of every denominator of `loss_agg`
    too. Needs `old_log_probs` `auto` or `recompute` (with the engine as old policy `w` is 1)."""
    is_level: Literal["token", "sequence"] = "token"
    """Whether `w` of `is_correction` is taken per token or per sample (geometric mean over its action
    tokens); GSPO, whose ratio is per sample, takes `sequence` only."""
    is_threshold: float = Field(2.0, gt=1.0)
    """Threshold C of the truncated / masked IS weight."""
    kl_coef: NonNegativeFloat = 0.0
    """Weight of the KL to the reference model (the initial one with `kl_target`); 0 disables the
    reference model entirely."""
    kl_target: PositiveFloat | None = None
    """Adaptive KL controller (Ziegler et al. 2019): after each step `kl_coef *= 1 + clip(KL / kl_target
    - 1, -0.2, 0.2) · samples / kl_horizon`, from the step's measured KL. Unset: `kl_coef` stays fixed."""
    kl_horizon: PositiveInt = 10000
    """Horizon (in samples) of the adaptive KL controller."""
    kl_estimator: KLEstimatorKind = "k3"
    """KL estimator, with `log r = log p_ref - log p` sampled from p: k1 = -log r, k2 = (log r)^2 / 2,
    k3 = r - 1 - log r, abs = |log r|, mse = (log r)^2 / 2 (k2 under its name in other frameworks)."""
    kl_in_reward: bool = False
    """Put the KL penalty into the reward (REINFORCE++ style) instead of the loss."""
    entropy_coef: NonNegativeFloat = 0.0
    """Weight of the entropy bonus."""
    gamma: float = Field(1.0, ge=0.0, le=1.0)
    """Discount for GAE and REINFORCE++ returns."""
    lam: float = Field(0.95, ge=0.0, le=1.0)
    """GAE lambda."""
    value_clip: PositiveFloat = 0.2
    """Clip range of the value loss around the old values."""
    value_coef: PositiveFloat = 0.5
    """Weight of the value loss (GAE only)."""
    adv_eps: PositiveFloat = 1e-6
    """Added to the std before dividing (GRPO's group std, the batch std of `whiten_advantages`)."""
    dynamic_sampling: bool = True
    """Drop groups whose rewards are all equal (they carry no GRPO signal). With `[distill]` no group is
    dropped: every one carries the teacher's per-token signal."""
    dynamic_sampling_budget: PositiveFloat = 4.0
    """With `dynamic_sampling`: groups dropped per group trained, at most, over the run. Past it an
    equal-reward group is trained (zero advantage: no gradient) instead of dropped, so a policy that
    has converged on most prompts cannot starve the trainer: a step costs at most about 1 + budget
    steps' worth of rollouts."""
    overlong_buffer: NonNegativeInt = 0
    """Soft over-long penalty: responses within this many tokens of the length cap are penalised
    linearly, up to `overlong_penalty`; 0 disables it."""
    overlong_penalty: NonNegativeFloat = 1.0
    """Largest over-long penalty subtracted from the reward."""
    moe_aux_coef: NonNegativeFloat = 0.0
    """Weight of the MoE load-balancing loss (Switch: `E · Σ f_i · P_i` over the experts actually
    used, replayed ones included), from the trainer's fp32 router logits; MoE models only."""
    moe_z_coef: NonNegativeFloat = 0.0
    """Weight of the MoE router z-loss (mean `logsumexp(router logits)^2`); MoE models only."""

    @model_validator(mode="after")
    def _check_combinations(self) -> "AlgorithmConfig":
        if self.is_correction != "none" and self.old_log_probs == "engine":
            raise ValueError(
                "algorithm.is_correction corrects the gap between the trainer's old policy and the engine, "
                "which is 1 when the engine's log-probs are the old policy: set algorithm.old_log_probs = "
                "'recompute' (or 'auto'), or algorithm.is_correction = 'none'"
            )
        if self.is_correction != "none" and self.policy_loss == "gspo" and self.is_level == "token":
            raise ValueError(
                "algorithm.policy_loss = 'gspo' has a per-sample ratio: a per-token IS factor would undo it; "
                "set algorithm.is_level = 'sequence'"
            )
        if self.kl_target is not None and self.kl_coef == 0:
            raise ValueError("algorithm.kl_target adapts kl_coef from its start value: set algorithm.kl_coef > 0")
        if self.cispo_eps_low is not None and self.policy_loss != "cispo":
            raise ValueError("algorithm.cispo_eps_low clips CISPO's weight: set algorithm.policy_loss = 'cispo'")
        if self.loss_agg_length is not None and self.aggregation != "seq-mean-token-sum-norm":
            raise ValueError(
                "algorithm.loss_agg_length is the constant of loss_agg = 'seq-mean-token-sum-norm': set that mode"
            )
        return self

    @property
    def aggregation(self) -> LossAggKind:
        """`loss_agg`, its default resolved."""
        if self.loss_agg is not None:
            return self.loss_agg
        return "seq-mean-token-mean" if self.policy_loss == "gspo" else "token-mean"

    @property
    def whiten(self) -> bool:
        """`whiten_advantages`, its default resolved."""
        if self.whiten_advantages is not None:
            return self.whiten_advantages
        return self.advantage in WHITENED_BY_DEFAULT

    def recompute_old(self, ppo_epochs: int) -> bool:
        """Whether the step recomputes the old policy's log-probs (`old_log_probs`, resolved)."""
        if self.old_log_probs != "auto":
            return self.old_log_probs == "recompute"
        return ppo_epochs > 1 or self.is_correction != "none"

    @property
    def uses_critic(self) -> bool:
        return self.advantage == "gae"

    @property
    def uses_reference(self) -> bool:
        return self.kl_coef > 0.0


class LoraConfig(Section):
    """LoRA: low-rank adapters (built with `peft`) are trained over a frozen base kept in `model.dtype`."""

    rank: PositiveInt = 16
    """Rank r of each adapter (A is r x in, B is out x r)."""
    alpha: PositiveFloat = 32.0
    """Scale numerator: an adapter adds `(alpha / rank) · B·A` to its layer's weight."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout on the adapters' input in training forwards (peft's `lora_dropout`). The engines sample
    without it, so anything above 0 makes the trainer's log-probs differ from the engines' by design."""
    target_modules: list[str] | None = None
    """Module names to adapt, as peft matches them (a name equals a module's last name parts, e.g.
    `q_proj` or `self_attn.o_proj`). Unset: every linear layer of the decoder blocks (MoE experts,
    routers and the vision tower only when named). A name that matches no linear layer is an error."""
    engine_weights: Literal["merged", "separate"] | None = None
    """How a built-in engine applies the adapters. `merged`: added into its weights at each refit, so a
    decode step costs the base model's; in bf16 the merged weight is rounded once, so the engine samples
    from a policy a little off the trainer's (bf16 base plus fp32 adapters), more as the adapters grow.
    `separate`: kept as fp32 LoRA layers beside the base and computed as the trainer computes them (the
    engine's log-probs then differ from the trainer's as a full fine-tune's do, and `engines.exact` can
    make them equal), for an extra pair of small matmuls per adapted layer. Unset: `merged`. vLLM engines
    always keep them separate, in their own kernels (`merged` is refused there)."""


class ActorConfig(Section):
    """The actor pool: the FSDP2 trainer of the policy (and reference, critic)."""

    ranks: PositiveInt = 1
    """Trainer processes in local mode (torchrun --nproc-per-node; one runs without torchrun); on Slurm the
    actor het group's nodes × GPUs decide it."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Trainer device; `auto` picks CUDA when available."""
    groups_per_step: PositiveInt = 8
    """Groups (prompts × rollout.n_samples samples) consumed per training step, across all ranks."""
    micro_batch_size: PositiveInt = 16
    """Sequences per forward/backward on one rank, when rows are padded (not packed)."""
    packing: Literal["auto", "on", "off"] = "auto"
    """Pack several samples into one row per micro-batch, up to `max_tokens_per_micro_batch` tokens,
    attention confined to each sample (instead of a row per sample, padded). `auto`: on, unless the model
    cannot be packed exactly (eager attention, sliding windows, linear attention or state-space layers)."""
    max_tokens_per_micro_batch: PositiveInt | None = None
    """Token budget of a packed micro-batch (a row, split over the CP group when `cp > 1`); unset:
    `micro_batch_size × rollout.max_total_tokens`, what a padded micro-batch may hold."""
    ppo_epochs: PositiveInt = 1
    """Passes over each step's batch."""
    mini_batches: PositiveInt = 1
    """Optimizer steps per epoch (the batch is cut into this many mini-batches)."""
    lr: PositiveFloat = 5e-4
    """Peak learning rate of AdamW."""
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0)
    """Floor of the decayed learning rate, as a fraction of `lr`."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Decay after warm-up, over `run.steps`."""
    warmup_steps: NonNegativeInt = 0
    """Linear warm-up steps."""
    weight_decay: NonNegativeFloat = 0.0
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    grad_clip: PositiveFloat = 1.0
    """Clip of the global gradient norm."""
    critic_lr: PositiveFloat = 1e-3
    """Learning rate of the critic (GAE only)."""
    critic_epochs: PositiveInt = 1
    """Value-update passes per step (may exceed ppo_epochs)."""
    activation_checkpointing: bool = False
    """Recompute each decoder block's activations in the backward pass."""
    logprob_chunk: PositiveInt = 1024
    """Tokens per chunk when computing log-probs and entropy, so fp32 [B, T, V] is never materialised."""
    logprob_kernel: Literal["auto", "torch", "compile", "triton"] = "auto"
    """How each chunk's log-probs, entropy and gradient are computed: `auto` (`triton` on CUDA GPUs with
    the triton package, the fastest there; `torch` elsewhere), `torch` (eager ops, any device),
    `compile` (the same math fused by `torch.compile`; compiles once per run), `triton` (hand-written
    kernels, CUDA GPUs with the triton package). All compute the same function (`bench/gpu_train.py`
    times them side by side)."""
    freeze_router: bool = True
    """Do not train MoE router (gate) weights (a train/inference consistency guard). Routers are
    found by their class (the one the model records `router_logits` from), whatever their names."""
    router_replay: bool = False
    """MoE router replay (a train/inference consistency guard): engines return the experts every
    token went to (vLLM's `--enable-return-routed-experts`; the builtin engine records the same) and
    each MoE layer of the trainer sends those tokens to the engine's experts, with gate weights from
    its own fp32 softmax, so the router still gets gradients. Tokens without routing (the last of a
    sample, a sample whose routing did not line up) keep the live choice. Needs an MoE model whose
    router is softmax then top-k (Qwen2/3-MoE, OLMoE, Mixtral, ...). The builtin engine records
    routing from Python hooks, so on a GPU it then decodes without CUDA graphs."""
    cp: PositiveInt = 1
    """Context-parallel degree (inside a node): Ulysses all-to-all over `cp` adjacent ranks, each running
    1/cp of every row; needs cp to divide the attention heads and attention `sdpa` or `flash_attention_2`."""
    ep: PositiveInt = 1
    """Expert-parallel degree (MoE only): each MoE layer's experts are split over groups of `ep` ranks
    inside a node (it must divide the experts per layer and the ranks per node); the other weights stay
    FSDP over all ranks."""
    ep_dispatch: Literal["all_to_all", "deep_ep"] = "all_to_all"
    """How tokens reach their experts' ranks under `ep > 1`: `all_to_all` (torch.distributed, any
    backend) or `deep_ep` (DeepEP's NVLink kernels; GPUs only, needs the `deep_ep` package)."""
    offload: Literal["none", "optimizer", "full"] = "none"
    """Host memory for trainer state on GPUs. `optimizer`: AdamW's moments live in pinned host memory
    between steps (copied to the GPU for the update and back: GPU memory for 8 bytes per parameter,
    freed); `full`: FSDP2's CPU offload, parameters, gradients and optimizer state all on the host,
    the update computed by the CPU (the most GPU memory saved, the slowest step). On a CPU trainer
    everything already lives in host memory: `optimizer` changes nothing there, `full` runs the same
    offload code path with no memory effect."""

    lora: LoraConfig | None = None
    """Train low-rank adapters instead of every weight (`[actor.lora]`, see docs/lora.md): the base
    stays frozen in `model.dtype`, only the adapters are optimised, refits send only the adapters and
    checkpoints are PEFT adapter directories. Unset: full fine-tuning."""

    @model_validator(mode="after")
    def _check_ep_dispatch(self) -> "ActorConfig":
        if self.ep_dispatch == "deep_ep" and self.ep == 1:
            raise ValueError("actor.ep_dispatch = 'deep_ep' moves tokens between EP ranks: set actor.ep > 1 with it")
        if self.ep_dispatch == "deep_ep" and self.device == "cpu":
            raise ValueError(
                "actor.ep_dispatch = 'deep_ep' runs on GPUs only: set actor.device = 'cuda' (or 'auto'), "
                "or actor.ep_dispatch = 'all_to_all'"
            )
        return self


class CheckpointConfig(Section):
    """Checkpoints: HF-layout safetensors + optimizer + run state, published atomically."""

    interval: NonNegativeInt = 50
    """Save every this many steps (0: only at the end and on request)."""
    keep_last: PositiveInt = 2
    """Whole checkpoints kept; older ones are deleted after a newer one is published."""
    save_optimizer: bool = True
    """Save optimizer and scheduler state (needed for an exact resume)."""
    shard_mb: PositiveInt = 4096
    """Largest safetensors shard of the saved policy (and critic), in MiB; a bigger tensor gets a shard alone."""
    background: bool = False
    """Write the periodic checkpoints behind the training: a step pays for copying the weights and the
    optimizer state into host memory, a thread writes, hashes and publishes them (the groups they cover
    are acked once published). Costs one more host copy of the weights and optimizer state while a save
    is in flight. Saves on request, at a stop and at the end wait until they are published."""
    resume: Literal["auto", "never", "required"] = "auto"
    """`auto`: resume when the run directory has a `latest` checkpoint; `never`: refuse a run
    directory that has one; `required`: fail unless one exists."""
