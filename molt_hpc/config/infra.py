"""Config sections for the run itself and its plumbing: run, buffer, refit, slurm, logging."""

import datetime
from typing import Literal

from pydantic import (
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    field_validator,
    model_validator,
)

from molt_hpc.config.base import Section


def slurm_time_seconds(text: str) -> int:
    """Seconds in a Slurm time limit: `MM`, `MM:SS`, `HH:MM:SS`, `D-HH`, `D-HH:MM` or `D-HH:MM:SS`."""
    days_text, has_days, clock = text.strip().rpartition("-")
    fields = clock.split(":")
    if not all(f.isdigit() for f in [*fields, *([days_text] if has_days else [])]) or len(fields) > 3:
        raise ValueError(f"{text!r} is not a Slurm time limit; write D-HH:MM:SS, HH:MM:SS or minutes")
    nums = [int(f) for f in fields]
    if has_days:  # D-HH[:MM[:SS]]
        nums += [0] * (3 - len(nums))
        return int(days_text) * 86400 + nums[0] * 3600 + nums[1] * 60 + nums[2]
    if len(nums) == 1:
        return nums[0] * 60
    if len(nums) == 2:
        return nums[0] * 60 + nums[1]
    return nums[0] * 3600 + nums[1] * 60 + nums[2]


class RunConfig(Section):
    """The run: its name, where it lives, how long it trains."""

    name: str = Field("tiny-cpu", pattern=r"^[A-Za-z0-9._-]+$")
    """Run name; the run directory is `<root>/<name>`."""
    root: str = "runs"
    """Directory holding run directories (on the shared filesystem for Slurm runs)."""
    steps: PositiveInt = 400
    """Training steps (optimizer updates of the policy) before the run ends."""
    seed: int = 0
    """Seed of everything random: data order, sampling, initialisation."""
    sync: bool = False
    """Synchronous mode: rollouts wait for each refit (staleness 0); for debugging and comparison."""
    stage: Literal["rl", "sft", "rm"] = "rl"
    """What the run trains; the command sets it (`molt-hpc run`: rl, `molt-hpc sft`: sft,
    `molt-hpc rm train`: rm), so a run directory knows how to be resumed."""
    stall_timeout_s: NonNegativeFloat = 1800.0
    """A run that records no training step for this long (counted from its start, then from its last
    step) is stopped after a checkpoint, with the rollout's first failure quoted; 0 never stops it."""


class BufferConfig(Section):
    """The replay buffer: the spool of finished groups between the engine pool and the actor pool."""

    backend: Literal["fs", "shm"] = "fs"
    """`fs`: a directory in the run directory (shared filesystem); `shm`: /dev/shm (both pools on one node)."""
    capacity: PositiveInt = 32
    """Unconsumed groups held at most; producers block beyond it (backpressure, never dropping)."""
    max_staleness: NonNegativeInt = 2
    """Groups made by a policy more than this many versions old are moved aside, not trained."""
    put_timeout_s: PositiveFloat = 3600.0
    """A producer blocked this long raises a clear error (the consumer is gone or stuck)."""
    lease_timeout_s: PositiveFloat = 600.0
    """A consumer that renews its lease (every get/ack/heartbeat) less often than this loses its claims
    to the pool (it died without acking); its restart under the same id returns them at once."""
    poll_interval_s: PositiveFloat = 0.05
    """Longest sleep between looks at the spool while a put waits for room or a get for groups; lower
    hands over faster and costs more metadata requests on a shared filesystem."""


class RefitConfig(Section):
    """The weight refit from the actor pool to the engines."""

    interval: PositiveInt = 1
    """Refit the engines every this many training steps."""
    bucket_mb: PositiveInt = 256
    """Size of one flat broadcast bucket, in MiB."""
    backend: Literal["auto", "gloo", "nccl", "ipc"] = "auto"
    """How weights reach the engines. `auto`: CUDA IPC to an engine on trainer rank 0's own GPU (NCCL
    refuses two ranks on one GPU), /dev/shm to one on its host when the trainer is on the CPU (if
    /dev/shm has room), else a broadcast group: NCCL from a GPU, gloo from the CPU. `ipc`: shared
    memory to every engine (an engine elsewhere is an error); `gloo` / `nccl`: that group for all."""
    timeout_s: float = Field(600.0, gt=0.0, le=86400.0)
    """Rendezvous and transfer timeout, at most a day (the engines' refit routes take no longer); also
    how long refits may keep failing (an engine restarting, unreachable, refusing the weights) before
    the run stops with the cause."""
    host: str = "auto"
    """Address the engines use to reach trainer rank 0's TCPStore; `auto`: this node's hostname
    (127.0.0.1 when the hostname does not resolve)."""


class SlurmGroupConfig(Section):
    """Resources of one het group of the Slurm job."""

    nodes: NonNegativeInt = 1
    """Nodes of this group (0 is an error: every group needs a node)."""
    gpus_per_node: NonNegativeInt = 0
    """GPUs requested per node (`--gpus-per-node`)."""
    cpus_per_task: PositiveInt = 2
    """CPUs per task."""
    mem: str | None = None
    """Memory per node (`--mem`, e.g. `200G`); unset leaves the partition default."""
    partition: str | None = None
    """Partition (queue)."""
    account: str | None = None
    """Account to charge."""
    qos: str | None = None
    """Quality of service."""
    constraint: str | None = None
    """Node feature constraint (`--constraint`)."""
    extra_sbatch: list[str] = Field(default_factory=list)
    """Extra `#SBATCH` options of this group, each written as `--key=value` (e.g. `--exclusive`)."""

    @field_validator("extra_sbatch")
    @classmethod
    def _check_extra_sbatch(cls, value: list[str]) -> list[str]:
        for item in value:
            if not item.startswith("-") or "\n" in item:
                raise ValueError(f"{item!r} is not one sbatch option; write each as `--key=value` on one line")
        return value


class SlurmConfig(Section):
    """The heterogeneous Slurm job: het group 0 is the actor pool, het group 1 the engine pool, and with
    `[sandbox]` het group 2 the sandbox server's CPU node."""

    actor: SlurmGroupConfig = Field(default_factory=SlurmGroupConfig)
    """Het group 0: the actor pool."""
    engines: SlurmGroupConfig = Field(default_factory=SlurmGroupConfig)
    """Het group 1: the engine pool."""
    sandboxes: SlurmGroupConfig = Field(default_factory=SlurmGroupConfig)
    """Het group 2, only with `[sandbox]`: the CPU node that runs the sandbox server, so code a model wrote
    never runs on a GPU node (one node, no GPUs; `sandbox.workers` and `cpus_per_task` size it)."""
    time: str = "01:00:00"
    """Time limit of the job (D-HH:MM:SS)."""
    job_name: str = "molt-hpc"
    """Slurm job name."""
    signal_lead_s: PositiveInt = 120
    """The job asks for a warning signal this many seconds before its time limit, to checkpoint and requeue."""
    requeue: bool = True
    """Requeue after a preemption or time-limit warning (resuming from the checkpoint and buffer)."""
    max_engine_restarts: NonNegativeInt = 3
    """Times a dead engine-pool step is relaunched inside the same allocation."""
    setup: list[str] = Field(default_factory=list)
    """Shell lines run before the job steps (e.g. `module load cuda`, `source .venv/bin/activate`)."""
    stop_timeout_s: PositiveInt | None = None
    """Longest wait for the actor pool to checkpoint and exit after a stop request (time-limit warning,
    preemption, cancel) before its step is killed; unset: the signal lead minus 30 s, at least half of it."""
    actor_script: str = "jobs/actor.py"
    """Script torchrun runs on every node of the actor pool as `SCRIPT RUN_DIR`; relative paths are
    taken from the molt-hpc checkout. Replace it only to wrap the trainer."""
    engine_script: str = "jobs/engine.py"
    """Script run on every node of the engine pool as `SCRIPT RUN_DIR --role pool`; relative paths are
    taken from the molt-hpc checkout. Replace it only to wrap the engine pool."""

    @field_validator("time", mode="before")
    @classmethod
    def _check_time(cls, value: object) -> object:
        if isinstance(value, datetime.time):  # an unquoted `time = 01:00:00` in TOML
            value = value.isoformat()
        if isinstance(value, str):
            slurm_time_seconds(value)
        return value

    @model_validator(mode="after")
    def _check_sandboxes(self) -> "SlurmConfig":
        group = self.sandboxes
        if group.nodes != 1 or group.gpus_per_node:
            raise ValueError(
                f"slurm.sandboxes asks for {group.nodes} nodes with {group.gpus_per_node} GPUs each: the sandbox "
                "group is one CPU node (model-written code never runs beside a GPU); set slurm.sandboxes.nodes = 1 "
                "and gpus_per_node = 0, and raise sandbox.workers with slurm.sandboxes.cpus_per_task for more at once"
            )
        return self

    @model_validator(mode="after")
    def _check_stop_timeout(self) -> "SlurmConfig":
        if self.stop_timeout_s is not None and self.stop_timeout_s >= self.signal_lead_s:
            raise ValueError(
                f"slurm.stop_timeout_s ({self.stop_timeout_s}) is not shorter than slurm.signal_lead_s "
                f"({self.signal_lead_s}): the job would be killed before the checkpoint wait ends"
            )
        return self

    @property
    def stop_wait_s(self) -> int:
        """Seconds the driver waits for the actor pool to checkpoint after a stop request."""
        if self.stop_timeout_s is not None:
            return self.stop_timeout_s
        return max(self.signal_lead_s - 30, self.signal_lead_s // 2)


class SpeedProfile(Section):
    """What one device does per second, for the plan's speed prediction (`molt_hpc.plan.speed`).
    `molt-hpc plan --calibrate` measures these on the machine it runs on."""

    memory_gb_per_s: PositiveFloat = 4000.0
    """Achievable memory bandwidth in GB/s (a large device-to-device copy: H200 ~4000 of 4800 nominal)."""
    matmul_tflops: PositiveFloat = 790.0
    """Achievable dense matmul rate in the model dtype, TFLOP/s (H200 bf16 ~790 of 989 nominal)."""
    mfu_small: float = Field(0.15, gt=0.0, le=1.0)
    """Fraction of `matmul_tflops` a training step reaches for models of hidden size < 2048 (small
    matmuls, launch-bound)."""
    mfu_medium: float = Field(0.30, gt=0.0, le=1.0)
    """The same for hidden size 2048-6143."""
    mfu_large: float = Field(0.40, gt=0.0, le=1.0)
    """The same for hidden size ≥ 6144."""
    decode_efficiency: float = Field(0.6, gt=0.0, le=1.0)
    """Fraction of `memory_gb_per_s` a decode step reaches reading the weights and the attended KV cache."""
    builtin_step_ms: NonNegativeFloat = 3.0
    """Host and launch time of one decode step of the built-in engine, beyond its memory and compute time
    (dominant for small models)."""
    builtin_row_ms: NonNegativeFloat = 0.0
    """Host time per decoding row of one built-in engine step, beyond `builtin_step_ms` (each row's token
    read back, appended and checked for its stop: the step grows with the rows in flight). Not known
    before a calibration of the machine: 0."""
    builtin_prefill_layer_ms: NonNegativeFloat = 0.11
    """Host time of one prefill call of the built-in engine per model layer, beyond its FLOPs (on a GPU the
    prefill into the slot cache replayed from a CUDA graph: 0.108 ms a layer for SmolLM2-135M on one H100,
    calibrated; the eager forward it replaced took ~0.8)."""
    vllm_step_ms: NonNegativeFloat = 0.6
    """The same for a vLLM engine (CUDA graphs, its scheduler)."""
    train_micro_batch_ms: NonNegativeFloat = 30.0
    """Host time of one trainer micro-batch (forward, backward, FSDP hooks) beyond its FLOPs, and of one
    optimizer update."""
    train_sample_ms: NonNegativeFloat = 0.0
    """Host time per trained sample per epoch beyond `train_micro_batch_ms` (the step's tensors built from its
    samples; packed rows attended a sample at a time where there is no variable-length kernel, as on CPUs).
    Not known before a calibration of the machine: 0."""
    shared_decode_rate: float = Field(0.0, ge=0.0, le=1.0)
    """Fraction of its own decode speed the engine keeps while the trainer trains on the same device (an
    asynchronous run with both pools on one GPU, or both on the CPU: the engine decodes the next step's samples
    beside the training). 0: the two take turns, a step is priced as rollout + train in sequence. The default
    is that price: `plan --calibrate` measures the pair on a GPU (0.67-0.74 on an H100, the trainer 1.02-1.06x),
    but priced with it the SmolLM2 recipe's step came out 2.44x short of its run against 1.77x in sequence (the
    live engine process is slower than its kernels' sharing explains: docs/scale.md), and on a CPU the pair
    measured alone misprices a run too."""
    shared_train_slowdown: float = Field(1.0, ge=1.0)
    """The trainer's step while the engine decodes beside it on the same device, over its step alone (unused
    while `shared_decode_rate` is 0)."""
    refit_gb_per_s: PositiveFloat = 250.0
    """Bandwidth of a refit inside one node (NCCL over NVLink; a host copy on CPU), GB/s."""
    refit_fixed_ms: NonNegativeFloat = 17.0
    """Fixed cost of one refit into built-in engines (pause the engines, the calls, resume), plus 2 ms per
    bucket. Measured whole refits of SmolLM2-135M read in place on one GPU, whose copy is under a millisecond:
    13-20 ms (H100, four runs), 17 and 31 ms (H200); an 8B model's call took 8 ms beyond the engine's copy."""
    vllm_refit_fixed_ms: NonNegativeFloat = 130.0
    """The same for vLLM engines (its pause, weight-update calls, reload and resume): 133 ms a refit of
    SmolLM2-135M on one H200, and 105-133 ms for 1 GB of weights over NCCL, where the link's part was ~3 ms."""
    host_link_gb_per_s: PositiveFloat = 40.0
    """Device-host bandwidth for offloaded trainer state (PCIe Gen5 x16), GB/s each way."""


CPU_PROFILE = {"memory_gb_per_s": 8.0, "matmul_tflops": 0.05, "mfu_small": 0.3, "mfu_medium": 0.3, "mfu_large": 0.3,
               "decode_efficiency": 0.5, "builtin_step_ms": 4.0, "builtin_prefill_layer_ms": 0.5,
               "train_micro_batch_ms": 40.0, "refit_gb_per_s": 2.0,
               "refit_fixed_ms": 30.0, "host_link_gb_per_s": 8.0}  # fmt: skip
"""A 2-core machine's defaults (`plan.cpu`); `molt-hpc plan --calibrate` replaces them with measured ones."""


class PlanConfig(Section):
    """The hardware `molt-hpc plan` (and the plan before `run` and `submit`) checks a config against, and
    the speed of its devices for the predicted step time."""

    gpu_memory_gib: PositiveFloat = 139.8
    """Memory of one GPU as torch reports it (`torch.cuda.get_device_properties(0).total_memory`):
    H200 139.8 GiB, H100 79.6 GiB, A100-80GB 79.2 GiB."""
    host_memory_gib: PositiveFloat | None = None
    """Host memory per node that the run may use. Unset: this machine's memory for a run on it (`molt-hpc
    run`, `plan --local`), 1800 GiB for a Slurm job (a DGX H100/H200 node has 2 TB: room is left for the
    OS and the page cache)."""
    network_gb_per_s: PositiveFloat = 45.0
    """Bandwidth between nodes, per GPU's NIC, in GB/s (400 Gb/s InfiniBand NDR reaches ~45): the refit
    sends from trainer rank 0 through one NIC."""
    cuda: SpeedProfile = Field(default_factory=SpeedProfile)
    """Speed of one GPU (`[plan.cuda]`; defaults: an H200 SXM) for the pools that run on GPUs."""
    cpu: SpeedProfile = Field(default_factory=lambda: SpeedProfile(**CPU_PROFILE))
    """Speed of the CPU (`[plan.cpu]`) for a pool with `device = "cpu"`."""


class WandbConfig(Section):
    """Weights & Biases: every `metrics.jsonl` record of the run, as one W&B run that a resumed or
    requeued job continues (needs `pip install 'molt-hpc[wandb]'`)."""

    project: str = "molt-hpc"
    """W&B project."""
    entity: str | None = None
    """W&B entity (team or user); your default entity when unset."""
    name: str | None = None
    """Display name of the W&B run; `run.name` when unset."""
    mode: Literal["auto", "online", "offline"] = "auto"
    """`online` uploads as it goes; `offline` writes `runs/<name>/wandb/` for a later `wandb sync`;
    `auto` is online when W&B credentials exist (WANDB_API_KEY or `wandb login`) and the W&B server
    answers within 3 s, else offline (compute nodes often have no network)."""
    tags: list[str] = Field(default_factory=list)
    """Tags of the W&B run."""


class TensorBoardConfig(Section):
    """TensorBoard event files of every `metrics.jsonl` record (needs `pip install 'molt-hpc[tensorboard]'`)."""

    dir: str | None = None
    """Where the event files go; `runs/<name>/tensorboard` when unset (`tensorboard --logdir` it)."""


class LoggingConfig(Section):
    """Logs, metrics and progress display."""

    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    """Log level of every process."""
    progress: Literal["auto", "bar", "lines"] = "auto"
    """`bar`: a progress bar; `lines`: one fixed-format line per step; `auto`: a bar on a terminal."""
    all_ranks: bool = False
    """Let every trainer rank log (by default only rank 0 does)."""
    wandb: WandbConfig | None = None
    """Log to Weights & Biases (`[logging.wandb]`, e.g. with `project = "..."`); off when absent."""
    tensorboard: TensorBoardConfig | None = None
    """Write TensorBoard event files (`[logging.tensorboard]`, may be empty); off when absent."""
