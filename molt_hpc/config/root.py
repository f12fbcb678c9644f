"""The root of the config tree and the rules that span sections.

Derived values are properties; validators only check, they never rewrite fields.
"""

from pydantic import Field, model_validator

from molt_hpc.config.base import Section
from molt_hpc.config.infra import (
    BufferConfig,
    LoggingConfig,
    PlanConfig,
    RefitConfig,
    RunConfig,
    SlurmConfig,
    slurm_time_seconds,
)
from molt_hpc.config.model import DataConfig, ModelConfig
from molt_hpc.config.rollout import EnginesConfig, RolloutConfig, RouterConfig
from molt_hpc.config.train import ActorConfig, AlgorithmConfig, CheckpointConfig

GROUP_ADVANTAGES = ("grpo", "dr_grpo", "rloo")


class MoltConfig(Section):
    """A whole run. Its defaults are the embedded tiny CPU recipe (`configs/tiny_cpu.toml`)."""

    run: RunConfig = Field(default_factory=RunConfig)
    """The run: name, directory, steps, seed."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    """The policy model."""
    data: DataConfig = Field(default_factory=DataConfig)
    """The prompt dataset."""
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    """Rollout orchestration and sampling."""
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    """Advantages and losses."""
    actor: ActorConfig = Field(default_factory=ActorConfig)
    """The trainer."""
    engines: EnginesConfig = Field(default_factory=EnginesConfig)
    """The inference engines."""
    router: RouterConfig = Field(default_factory=RouterConfig)
    """The session-affine router."""
    buffer: BufferConfig = Field(default_factory=BufferConfig)
    """The replay buffer."""
    refit: RefitConfig = Field(default_factory=RefitConfig)
    """The weight refit."""
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    """Checkpoints and resume."""
    slurm: SlurmConfig = Field(default_factory=SlurmConfig)
    """The heterogeneous Slurm job."""
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    """Logs and metrics."""
    plan: PlanConfig = Field(default_factory=PlanConfig)
    """The hardware the memory plan checks against (`molt-hpc plan`)."""

    @model_validator(mode="after")
    def _cross_section_rules(self) -> "MoltConfig":
        alg, ro, act = self.algorithm, self.rollout, self.actor
        if alg.advantage in GROUP_ADVANTAGES and ro.n_samples < 2:
            raise ValueError(
                f"rollout.n_samples = {ro.n_samples} but algorithm.advantage = {alg.advantage!r} "
                "compares samples within a group: set rollout.n_samples >= 2"
            )
        if ro.max_new_tokens > ro.max_total_tokens:
            raise ValueError(
                f"rollout.max_new_tokens ({ro.max_new_tokens}) exceeds rollout.max_total_tokens "
                f"({ro.max_total_tokens}): raise max_total_tokens or lower max_new_tokens"
            )
        if ro.max_total_tokens > self.engines.max_model_len:
            raise ValueError(
                f"rollout.max_total_tokens ({ro.max_total_tokens}) exceeds engines.max_model_len "
                f"({self.engines.max_model_len}): raise engines.max_model_len"
            )
        if act.mini_batches > act.groups_per_step:
            raise ValueError(
                f"actor.mini_batches ({act.mini_batches}) exceeds actor.groups_per_step "
                f"({act.groups_per_step}): a mini-batch needs at least one group"
            )
        if self.data.max_prompt_tokens >= ro.max_total_tokens:
            raise ValueError(
                f"data.max_prompt_tokens ({self.data.max_prompt_tokens}) leaves no room to generate "
                f"within rollout.max_total_tokens ({ro.max_total_tokens})"
            )
        if self.engines.kind == "vllm" and act.device == "cpu":
            raise ValueError(
                "engines.kind = 'vllm' refits over NCCL from a GPU: set actor.device = 'cuda' (or 'auto' on a GPU node)"
            )
        self._check_sequences()
        self._check_tiny_model()
        self._check_router_replay()
        self._check_slurm()
        return self

    def _check_sequences(self) -> None:
        act, attn = self.actor, self.model.attn_implementation
        if attn == "eager" and (act.cp > 1 or act.packing == "on"):
            what = f"actor.cp = {act.cp}" if act.cp > 1 else "actor.packing = 'on'"
            raise ValueError(
                f"{what} needs model.attn_implementation 'sdpa' or 'flash_attention_2' (eager attention "
                "cannot confine attention to a packed sample or run on a CP slice)"
            )
        budget = act.max_tokens_per_micro_batch
        if budget is not None and budget < self.rollout.max_total_tokens:
            raise ValueError(
                f"actor.max_tokens_per_micro_batch ({budget}) is below rollout.max_total_tokens "
                f"({self.rollout.max_total_tokens}): a packed micro-batch must hold the longest sample; raise it"
            )
        if self.model.path == "builtin:tiny-char" and act.cp > 1:
            tiny = self.model.tiny
            if tiny.num_heads % act.cp:
                raise ValueError(
                    f"actor.cp = {act.cp} does not divide model.tiny.num_heads ({tiny.num_heads}): each CP rank "
                    "runs heads / cp of them"
                )

    def _check_router_replay(self) -> None:
        if not self.actor.router_replay or self.engines.kind != "vllm":
            return
        refused = ("--speculative-config", "--pipeline-parallel-size", "-pp", "--kv-transfer-config")
        bad = [a for a in self.engines.extra_args if a.split("=", 1)[0] in refused]
        if bad:
            raise ValueError(
                f"actor.router_replay = true with engines.extra_args {bad}: vLLM 0.26 returns no (or misaligned) "
                "routed experts with speculative decoding, pipeline parallelism or a KV connector; drop them or set "
                "actor.router_replay = false"
            )

    def _check_tiny_model(self) -> None:
        tiny = self.model.tiny
        if tiny.hidden_size % tiny.num_heads:
            raise ValueError(
                f"model.tiny.num_heads ({tiny.num_heads}) must divide model.tiny.hidden_size ({tiny.hidden_size})"
            )
        if tiny.num_heads % tiny.num_kv_heads:
            raise ValueError(
                f"model.tiny.num_kv_heads ({tiny.num_kv_heads}) must divide model.tiny.num_heads ({tiny.num_heads})"
            )

    def _check_slurm(self) -> None:
        sl, act = self.slurm, self.actor
        for name, group in (("actor", sl.actor), ("engines", sl.engines)):
            if group.nodes == 0:
                raise ValueError(f"slurm.{name}.nodes is 0: every het group needs at least one node")
        gpus = sl.actor.nodes * sl.actor.gpus_per_node
        inner = act.cp * act.ep
        if gpus and gpus % inner:
            raise ValueError(
                f"the actor pool has {gpus} GPUs (slurm.actor.nodes × gpus_per_node) which does not "
                f"divide into actor.cp × actor.ep = {inner}: change one so the GPUs divide evenly"
            )
        if sl.actor.gpus_per_node and inner > sl.actor.gpus_per_node:
            raise ValueError(
                f"actor.cp × actor.ep = {inner} exceeds slurm.actor.gpus_per_node = "
                f"{sl.actor.gpus_per_node}: context and expert parallelism stay inside a node"
            )
        if sl.actor.gpus_per_node and sl.actor.gpus_per_node % act.ep:
            raise ValueError(
                f"actor.ep = {act.ep} does not divide slurm.actor.gpus_per_node = {sl.actor.gpus_per_node}: an "
                "expert-parallel group stays inside a node, so pick an ep that divides the GPUs per node"
            )
        engine_gpus = sl.engines.gpus_per_node
        if engine_gpus and engine_gpus % self.engines.gpus_per_engine:
            raise ValueError(
                f"slurm.engines.gpus_per_node ({engine_gpus}) is not a multiple of engines.tensor_parallel × "
                f"engines.data_parallel ({self.engines.gpus_per_engine})"
            )
        if sl.signal_lead_s >= slurm_time_seconds(sl.time):
            raise ValueError(
                f"slurm.signal_lead_s ({sl.signal_lead_s}) is not shorter than slurm.time ({sl.time}): "
                "the warning would come before the job starts; lower the lead or raise the time limit"
            )
