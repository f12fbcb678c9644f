"""Config sections for the engine-pool side: rollout orchestration, inference engines, the router."""

from typing import Literal

from pydantic import Field, NonNegativeInt, PositiveFloat, PositiveInt, model_validator

from molt_hpc.config.base import Section
from molt_hpc.net import LOOPBACK


class RolloutConfig(Section):
    """Steps 2-3 of the RL loop: the orchestrator, the agent and its sampling."""

    agent: str = "envs/reverse.py"
    """The agent: a file path (`envs/math.py`) or an importable module (`my_pkg.my_env`) that
    declares one `Env` subclass or one `ChatAgent` subclass."""
    tool_parser: Literal["hermes", "llama3", "none"] = "hermes"
    """Chat mode: how the chat endpoint reads tool calls in a reply to a request that offers `tools`
    (the tools are always rendered by the model's own chat template). `hermes`: Hermes / Qwen 2.5 / Qwen 3
    and the built-in tiny model, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; `llama3`:
    Llama 3.1 / 3.2 JSON, `{"name": ..., "parameters": {...}}`; `none`: replies stay text (the agent
    parses them) and `tool_choice` `required` or a named function is refused. Pick the format the
    model was trained on."""
    n_samples: PositiveInt = 8
    """Samples per prompt: the group size of GRPO-style advantages."""
    groups_in_flight: PositiveInt = 16
    """Groups kept in flight through the router at once (at most)."""
    admission: Literal["bound", "kept_share"] = "bound"
    """How groups in flight count against the staleness bound (`(version + buffer.max_staleness + 1) ×
    actor.groups_per_step` groups accepted or in flight). `bound`: each as one that will be kept, so no
    accepted group is ever too stale, but under dynamic sampling, which drops most groups early in a run,
    the engines hold a fraction of the work they could. `kept_share`: each at the share of recent groups
    that were kept, so the engines hold about 1/share more; a group that still finishes past the bound is
    dropped as stale (`groups_filtered_stale`), never trained. Asynchronous runs only (not `run.sync`)."""
    temperature: PositiveFloat = 1.0
    """Sampling temperature (engine log-probs are taken after it, so ratios stay exact)."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass."""
    top_k: NonNegativeInt = 0
    """Top-k sampling; 0 disables it."""
    max_new_tokens: PositiveInt = 6
    """Cap on the tokens generated in one turn."""
    max_total_tokens: PositiveInt = 128
    """Cap on a whole trajectory (prompt + every turn); each turn gets what is left."""
    max_turns: PositiveInt = 1
    """Most model turns of a multi-turn episode."""
    max_images: PositiveInt = 4
    """Vision-language models: most images one trajectory carries (its prompt's and its observations').
    A row with more is a bad row; an observation that would pass it ends the episode (`budget_exhausted`);
    vLLM engines accept this many per request (`--limit-mm-per-prompt`)."""
    env_timeout_s: PositiveFloat = 30.0
    """A single `Env.step` (or `reset`, or the env's construction) that takes longer fails its sample; with
    `env_workers`, the worker running it is killed and a fresh one takes its place (there, construction
    and `reset` run as one call allowed twice this). A chat-mode episode gets
    `env_timeout_s + max_turns × request_timeout_s` in all."""
    env_workers: NonNegativeInt | Literal["auto"] = "auto"
    """Processes that run the env's construction, `reset` and `step` (env mode), so that an env holding the
    GIL (a runaway regular expression, a long C call) cannot freeze the orchestrator: a call past
    `env_timeout_s` kills its worker and fails only its sample. An episode stays in one worker. `auto`:
    one per 8 usable cores, at least 2 and at most 8. 0 runs envs in the orchestrator's own threads (no
    process boundary; a GIL-holding env freezes the rollout). Chat-mode agents run in the orchestrator."""
    on_env_error: Literal["drop_group", "retry"] = "drop_group"
    """A failed sample (env raised or timed out) drops its group, or is retried from its start.
    Engine failures (lost connection, 5xx, an aborted request) are always retried from the start."""
    max_retries: NonNegativeInt = 2
    """Retries of a sample whose env failed (with `on_env_error = "retry"`) before its group is dropped."""
    max_consecutive_failures: PositiveInt = 20
    """This many groups failing in a row (env errors, or engines failing every retry) stop the run after a
    checkpoint, quoting the first failure: a broken env fails every group, a flaky one rarely twice in a row."""
    request_timeout_s: PositiveFloat = 120.0
    """HTTP timeout of one generate call."""
    stall_report_s: PositiveFloat = 300.0
    """When the orchestrator's event loop has not turned for this long (an env holding the GIL: a runaway
    regular expression, a long C call), every thread's stack goes to `logs/rollout.log`, again each period
    while it lasts, so the stall can be traced; the run itself is not stopped."""


All2AllBackend = Literal[
    "allgather_reducescatter",
    "deepep_high_throughput",
    "deepep_low_latency",
    "deepep_v2",
    "mori_high_throughput",
    "mori_low_latency",
    "nixl_ep",
    "flashinfer_nvlink_two_sided",
    "flashinfer_nvlink_one_sided",
]
"""vLLM 0.26's `--all2all-backend` choices (less the removed `naive` and `pplx`)."""


class EnginesConfig(Section):
    """The inference engines of the engine pool."""

    kind: Literal["builtin", "vllm"] = "builtin"
    """`builtin`: the PyTorch + transformers engine that runs anywhere (CPU included);
    `vllm`: `vllm serve` processes (GPU clusters; needs the `gpu` extra)."""
    count: PositiveInt = 1
    """Engines in local mode; on Slurm, engines per engine-pool node, or the job's engines when
    `nodes_per_engine > 1` (one engine then spans several nodes)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Engine device; `auto` picks CUDA when available."""
    max_batch: PositiveInt = 64
    """Most sequences one engine decodes together."""
    max_model_len: PositiveInt = 512
    """Longest sequence (prompt + completion) an engine accepts."""
    tensor_parallel: PositiveInt = 1
    """GPUs per engine (vLLM tensor parallelism)."""
    data_parallel: PositiveInt = 1
    """vLLM: data-parallel replicas inside one engine (`--data-parallel-size`), each of
    `tensor_parallel` GPUs, behind the engine's one address; an engine takes
    `tensor_parallel × data_parallel` GPUs. With `expert_parallel`, the MoE layers' experts spread over
    all of them and tokens move between replicas by `all2all_backend`."""
    nodes_per_engine: PositiveInt = 1
    """vLLM on Slurm: nodes one engine spans (vLLM's multi-node data parallelism, no Ray). The engine's
    `data_parallel × tensor_parallel` GPUs are all of its nodes' GPUs, `data_parallel / nodes_per_engine`
    replicas of `tensor_parallel` GPUs on each node (tensor parallelism stays inside a node); with
    `expert_parallel`, the experts spread over every GPU of the engine. The engine's first node runs the
    serving `vllm serve` (the engine's one address, its registration); the others run it `--headless`.
    The engine het group then has `count × nodes_per_engine` nodes (`slurm.engines.nodes`)."""
    expert_parallel: bool = False
    """vLLM: expert parallelism for MoE layers (`--enable-expert-parallel`): each of the engine's
    `tensor_parallel × data_parallel` GPUs holds whole experts (E / that many) instead of a slice of
    every expert. Needs at least two GPUs per engine."""
    all2all_backend: All2AllBackend = "allgather_reducescatter"
    """vLLM: how tokens reach their experts' GPUs under `expert_parallel` (`--all2all-backend`); vLLM
    runs these kernels only with `data_parallel > 1`. `deepep_*` need the `deep_ep` package (built for
    vLLM's torch) next to vLLM; `deepep_low_latency` also needs NVSHMEM with IBGDA."""
    gpu_memory_utilization: float = Field(0.85, gt=0.0, le=1.0)
    """Fraction of its GPU's memory one engine may take, whatever its kind: vLLM reserves it at start
    (weights, activations, KV cache); the built-in engine's allocator is capped at it, and its weights
    plus its preallocated KV cache (`max_batch` × `max_model_len`) must fit under it. Where the pools
    share a GPU, the trainer keeps the rest."""
    enforce_eager: bool = False
    """Disable CUDA graphs (a train/inference consistency guard; slower decode)."""
    sample_in_graph: bool = True
    """Builtin engine on a GPU: record the sampling of plain requests (temperature only, no top-k/top-p/
    min-p, no seed, no top log-probs) inside the decode step's CUDA graph; other requests sample eagerly."""
    fuse_projections: bool = True
    """Builtin engine on a GPU: one matmul per layer for q/k/v and one for gate/up (same parameters and
    names; refits write the fused weights)."""
    compile_decode: bool = False
    """Builtin engine on a GPU: compile the decode step with `torch.compile` (inductor, dynamic shapes) before
    its CUDA graphs record it, so each layer's norms, rotary, residuals and activation run as a few fused
    kernels instead of ~30 small ones (0.5B shape, 64 rows, one H100: 3.76 -> 2.15 ms a step). Costs one
    compile when the engine starts (~100 s there; cached on disk for the next start), so it pays in
    decode-bound runs, not in short or prefill-bound ones (docs/speed.md); off under `enforce_eager` and
    with router replay (it records from Python hooks)."""
    prefill_interval: PositiveInt = 8
    """Builtin engine: decode steps between two prefills while rows decode, unless the newcomers would fill
    half of `max_batch` (then at once; with nothing decoding, at once too). A prefill of a few rows costs
    about the host time of one of many, so newcomers that wait up to this many steps are prefilled
    together; 1 prefills at every step."""
    prefix_caching: bool = True
    """Reuse the KV cache of shared prefixes (vLLM)."""
    max_num_batched_tokens: PositiveInt | None = None
    """Tokens one vLLM scheduler step may batch (prefill chunks and decodes together,
    `--max-num-batched-tokens`); unset: vLLM's default. Larger budgets prefill a step's many prompts
    in fewer steps (`bench/gpu_vllm_one.py --sweep` measures it)."""
    extra_args: list[str] = Field(default_factory=list)
    """Extra command-line arguments for `vllm serve`."""
    threads: NonNegativeInt = 0
    """torch CPU threads per engine process; 0 keeps torch's default."""
    exact: bool = False
    """Builtin engine: the engine's decode and the trainer's log-prob forward compute every
    token's log-prob with batch-invariant ops (`docs/exact.md`), so both give the same bits for the same
    tokens and weights, whatever the batch, and a same-version token's importance ratio is exactly 1. The
    trainer's policy runs the same ops (`actor.logprob_kernel` and `actor.logprob_chunk` are then unused).
    Needs `engines.device` and `actor.device` both `cpu` or both `cuda` (GPUs of one type, with triton;
    Llama-form RMSNorm there; the engine runs without CUDA graphs), a text model (dense, or MoE with transformers 5
    softmax -> top-k routers and stacked experts), `rollout.top_p` = 1 and `rollout.top_k` = 0, with
    `[actor.lora]` its `engine_weights = 'separate'` and no adapted LM head, `actor.cp` = 1. Costs rollout and
    trainer speed."""
    max_restarts: NonNegativeInt = 3
    """Times one dead engine process is restarted in place by its node's pool before the pool gives up."""
    host: str = "127.0.0.1"
    """Address the engines and the router listen on (ports come from the kernel). `0.0.0.0` listens on
    every interface and registers the node's hostname (multi-node runs)."""
    logprobs_mode: Literal["processed_logprobs", "raw_logprobs"] = "processed_logprobs"
    """Log-probs a vLLM engine returns: `processed_logprobs` are taken after temperature/top-k/top-p,
    what the trainer recomputes (the importance ratio needs them); `raw_logprobs` come before them."""
    startup_timeout_s: PositiveFloat = 900.0
    """Seconds a vLLM engine may take to load, compile and capture graphs before `/health` answers."""

    @model_validator(mode="after")
    def _check_vllm_device(self) -> "EnginesConfig":
        if self.kind == "vllm" and self.device == "cpu":
            raise ValueError(
                "engines.kind = 'vllm' runs on GPUs but engines.device = 'cpu': set engines.device = 'cuda' "
                "(or 'auto'), or use engines.kind = 'builtin' on a CPU"
            )
        self._check_vllm_parallel()
        self._check_span()
        return self

    def _check_span(self) -> None:
        n = self.nodes_per_engine
        if n == 1:
            return
        if self.kind != "vllm":
            raise ValueError(
                f"engines.nodes_per_engine = {n} spans an engine over several nodes, which only vLLM engines "
                "do: set engines.kind = 'vllm', or engines.nodes_per_engine = 1"
            )
        if self.data_parallel % n:
            raise ValueError(
                f"engines.data_parallel = {self.data_parallel} does not split evenly over engines.nodes_per_engine "
                f"= {n} nodes (each node hosts data_parallel / nodes_per_engine replicas): make data_parallel a "
                f"multiple of {n}"
            )
        if self.host in LOOPBACK:
            raise ValueError(
                f"engines.nodes_per_engine = {n} but engines.host = {self.host!r} is loopback: the engine's other "
                "nodes must reach its first one; set engines.host = '0.0.0.0'"
            )

    def _check_vllm_parallel(self) -> None:
        default = type(self).model_fields["all2all_backend"].default
        used = [
            name
            for name, on in (
                ("engines.data_parallel", self.data_parallel > 1),
                ("engines.expert_parallel", self.expert_parallel),
                ("engines.all2all_backend", self.all2all_backend != default),
            )
            if on
        ]
        if used and self.kind != "vllm":
            raise ValueError(f"{', '.join(used)} configure vLLM engines: set engines.kind = 'vllm' or leave them unset")
        if self.expert_parallel and self.gpus_per_engine == 1:
            raise ValueError(
                "engines.expert_parallel spreads experts over an engine's GPUs but it has one: raise "
                "engines.tensor_parallel or engines.data_parallel"
            )
        if self.all2all_backend != default and not (self.expert_parallel and self.data_parallel > 1):
            raise ValueError(
                f"engines.all2all_backend = {self.all2all_backend!r} is used by vLLM only with "
                "engines.expert_parallel = true and engines.data_parallel > 1: set both, or leave the backend unset"
            )

    @property
    def gpus_per_engine(self) -> int:
        return self.tensor_parallel * self.data_parallel

    @property
    def gpus_per_engine_node(self) -> int:
        """GPUs an engine takes on each of its nodes."""
        return self.gpus_per_engine // self.nodes_per_engine


class RouterConfig(Section):
    """The HTTP router in front of the engines (consistent hashing on the session id)."""

    kind: Literal["builtin", "vllm-router"] = "builtin"
    """`builtin`: ours (Python): bounded loads, failover of a request whose engine fails before
    answering, health ejection, the run token checked on every route. `vllm-router`: vLLM's router
    (Rust, `pip install 'molt-hpc[vllm-router]'`), consistent hashing on the session id with less
    overhead per request; requests still need the token at the engines, but the router's own admin
    routes take none (the supervisor stops the run if a worker that is not an engine of this run
    appears). The other router fields apply to `builtin` only, except `health_interval_s`."""
    balance_factor: float = Field(1.25, ge=1.0)
    """Bounded loads: an engine takes at most ceil(c · average) in-flight sessions; overflow walks the ring."""
    virtual_nodes: PositiveInt = 160
    """Points per engine on the hash ring."""
    health_interval_s: PositiveFloat = 2.0
    """Seconds between health checks of each engine."""
    connect_retries: PositiveInt = 3
    """Engines tried for one request when connections fail."""
