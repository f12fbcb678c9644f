"""The root of the config tree and the rules that span sections.

Derived values are properties; validators only check, they never rewrite fields.
"""

from pydantic import Field, model_validator

from molt_hpc.config.base import Section
from molt_hpc.config.distill import DistillConfig
from molt_hpc.config.evaluation import EvalConfig
from molt_hpc.config.exact import exact_problem
from molt_hpc.config.generator import overlapping_seeds
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
from molt_hpc.config.sandbox import SandboxConfig
from molt_hpc.config.stages import RewardModelConfig, RewardTrainConfig, SftConfig
from molt_hpc.config.train import ActorConfig, AlgorithmConfig, CheckpointConfig
from molt_hpc.config.vllm_lora import vllm_lora_problem

GROUP_ADVANTAGES = ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline")


class MoltConfig(Section):
    """A whole run. Its defaults are the embedded tiny CPU recipe (`configs/tiny_cpu.toml`)."""

    run: RunConfig = Field(default_factory=RunConfig)
    """The run: name, directory, steps, seed."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    """The policy model."""
    data: DataConfig = Field(default_factory=DataConfig)
    """The prompt dataset."""
    eval: EvalConfig | None = None
    """Held-out evaluation during the run (`[eval]` with at least `path`)."""
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
    sft: SftConfig | None = None
    """Supervised fine-tuning (`molt-hpc sft`; `[sft]` with at least `data`)."""
    rm: RewardTrainConfig | None = None
    """Reward-model training (`molt-hpc rm train`; `[rm]` with at least `data`)."""
    reward_model: RewardModelConfig | None = None
    """A trained reward model scoring the rollouts of `molt-hpc run` (`[reward_model]` with at least `path`)."""
    distill: DistillConfig | None = None
    """On-policy distillation from a frozen teacher in `molt-hpc run` (`[distill]` with at least `teacher`)."""
    sandbox: SandboxConfig | None = None
    """The service that runs untrusted code for envs (`state.sandbox.run(code)`; `[sandbox]`, all fields optional)."""
    plan: PlanConfig = Field(default_factory=PlanConfig)
    """The hardware the plan checks memory against and predicts speed on (`molt-hpc plan`)."""

    @model_validator(mode="after")
    def _cross_section_rules(self) -> "MoltConfig":
        alg, ro, act = self.algorithm, self.rollout, self.actor
        distilled = self.distill is not None and self.distill.combine == "replace"  # the env's advantage is unused
        if alg.advantage in GROUP_ADVANTAGES and ro.n_samples < 2 and not distilled:
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
        if act.lora is not None and self.engines.kind == "vllm" and (problem := vllm_lora_problem(self)):
            raise ValueError(problem)
        if ro.admission == "kept_share" and self.run.sync:
            raise ValueError(
                "rollout.admission = 'kept_share' admits groups beyond one batch per version, which run.sync "
                "forbids: set rollout.admission = 'bound', or run.sync = false"
            )
        if self.engines.exact and (problem := exact_problem(self)):
            raise ValueError(problem)
        self._check_sequences()
        self._check_eval()
        self._check_stages()
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
        longest, what = self.longest_row
        if budget is not None and budget < longest:
            raise ValueError(
                f"actor.max_tokens_per_micro_batch ({budget}) is below {what} ({longest}): a packed micro-batch "
                "must hold the longest sample; raise it"
            )
        if self.model.path == "builtin:tiny-char" and act.cp > 1:
            tiny = self.model.tiny
            if tiny.num_heads % act.cp:
                raise ValueError(
                    f"actor.cp = {act.cp} does not divide model.tiny.num_heads ({tiny.num_heads}): each CP rank "
                    "runs heads / cp of them"
                )

    def _check_eval(self) -> None:
        ev, interval = self.eval, self.checkpoint.interval
        both = ev is not None and ev.generator is not None and self.data.generator is not None
        if both and (overlap := overlapping_seeds(self.data.generator, ev.generator)):
            raise ValueError(f"{overlap}: held-out rows must not be training rows; move one seed range")
        if ev is not None and ev.best_metric is not None and (interval == 0 or ev.every % interval):
            raise ValueError(
                f"eval.best_metric names a checkpoint of an evaluated version: set eval.every ({ev.every}) to a "
                f"multiple of checkpoint.interval ({interval}), which must not be 0"
            )

    @property
    def longest_row(self) -> tuple[int, str]:
        """(tokens, what sets it) of the longest row the trainer may meet: a trajectory, an SFT row or a pair."""
        if self.run.stage == "sft" and self.sft is not None:
            return self.sft.max_tokens, "sft.max_tokens"
        if self.run.stage == "rm" and self.rm is not None:
            return 2 * self.rm.max_tokens, "2 × rm.max_tokens (a pair's two sides share a row)"
        return self.rollout.max_total_tokens, "rollout.max_total_tokens"

    def _check_stages(self) -> None:
        stage = self.run.stage
        if stage != "rl" and getattr(self, stage) is None:
            command = "molt-hpc sft" if stage == "sft" else "molt-hpc rm train"
            raise ValueError(f"`{command}` needs a [{stage}] section with at least `data` (the training file)")
        if stage != "rl" and self.actor.router_replay:
            raise ValueError(
                f"actor.router_replay = true but run.stage = {stage!r} has no engines whose routing could be "
                "replayed: set actor.router_replay = false for this stage"
            )
        if stage != "rl" and self.actor.lora is not None:
            raise ValueError(
                f"[actor.lora] with run.stage = {stage!r} is not supported yet (LoRA trains the RL policy only): "
                "drop [actor.lora] for this stage"
            )
        rm = self.reward_model
        if rm is not None and rm.max_model_len is not None and rm.max_model_len < self.rollout.max_total_tokens:
            raise ValueError(
                f"reward_model.max_model_len ({rm.max_model_len}) is below rollout.max_total_tokens "
                f"({self.rollout.max_total_tokens}): the scorer must take whole rollouts; raise it or leave it unset"
            )
        if rm is not None and rm.kind == "vllm" and rm.device == "cpu":
            raise ValueError(
                "reward_model.kind = 'vllm' runs on GPUs but reward_model.device = 'cpu': set it to 'cuda' or "
                "'auto', or use reward_model.kind = 'builtin'"
            )
        self._check_vllm_teacher()

    def _check_vllm_teacher(self) -> None:
        dist = self.distill
        if dist is None or dist.kind != "vllm":
            return
        if dist.device == "cpu":
            raise ValueError(
                "distill.kind = 'vllm' runs on GPUs but distill.device = 'cpu': set it to 'cuda' or 'auto', or use "
                "distill.kind = 'builtin'"
            )
        if self.rollout.temperature != 1.0:
            raise ValueError(
                f"distill.kind = 'vllm' scores with vLLM's prompt log-probs, which are of the raw distribution "
                f"(temperature 1), but rollout.temperature = {self.rollout.temperature}: set rollout.temperature "
                "= 1, or use distill.kind = 'builtin' (it scores at the rollout's temperature)"
            )

    @property
    def scorer_max_len(self) -> int:
        """Longest sequence a reward-model scorer accepts."""
        rm = self.reward_model
        return rm.max_model_len if rm is not None and rm.max_model_len else self.engines.max_model_len

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

    def _check_engine_span(self) -> None:
        """An engine over several nodes fills them: its het group has `count × nodes_per_engine` nodes of
        `tensor_parallel × data_parallel / nodes_per_engine` GPUs each."""
        eng, group = self.engines, self.slurm.engines
        want = eng.count * eng.nodes_per_engine
        if group.nodes != want:
            raise ValueError(
                f"slurm.engines.nodes = {group.nodes} but engines.count × engines.nodes_per_engine = {eng.count} × "
                f"{eng.nodes_per_engine} = {want}: set slurm.engines.nodes = {want} (or change engines.count, the "
                "job's engines when an engine spans nodes)"
            )
        if group.gpus_per_node and group.gpus_per_node != eng.gpus_per_engine_node:
            raise ValueError(
                f"an engine of engines.tensor_parallel × engines.data_parallel = {eng.gpus_per_engine} GPUs over "
                f"engines.nodes_per_engine = {eng.nodes_per_engine} nodes takes {eng.gpus_per_engine_node} GPUs per "
                f"node but slurm.engines.gpus_per_node = {group.gpus_per_node}: make data_parallel × tensor_parallel"
                f" = {eng.nodes_per_engine * group.gpus_per_node}"
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
        if self.engines.nodes_per_engine > 1:
            self._check_engine_span()
        elif engine_gpus and engine_gpus % self.engines.gpus_per_engine:
            raise ValueError(
                f"slurm.engines.gpus_per_node ({engine_gpus}) is not a multiple of engines.tensor_parallel × "
                f"engines.data_parallel ({self.engines.gpus_per_engine})"
            )
        if sl.signal_lead_s >= slurm_time_seconds(sl.time):
            raise ValueError(
                f"slurm.signal_lead_s ({sl.signal_lead_s}) is not shorter than slurm.time ({sl.time}): "
                "the warning would come before the job starts; lower the lead or raise the time limit"
            )
