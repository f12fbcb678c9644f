"""The plan of a config: where the pools run, what each GPU and node holds, and whether it fits.

A GPU fits when the trainer's predicted peak (what `torch.cuda.max_memory_allocated` counts) times the
allocator's slack, plus the CUDA context and NCCL buffers, is within `plan.gpu_memory_gib`; an
engine GPU when its weights and working memory leave KV cache for one `max_model_len` sequence; a
node when the host memory the trainer ranks take (loading, offloaded state) is within
`plan.host_memory_gib` (unset: this machine's memory for a local run). Blockers are what no amount of
memory fixes: shapes a parallelism cannot split.
"""

import math
import os
from dataclasses import dataclass, field

from molt_hpc.config import MoltConfig
from molt_hpc.plan.arch import Arch
from molt_hpc.plan.engine import (
    GIB,
    EngineMemory,
    Refit,
    builtin_adapters,
    engine_memory,
    largest_tensor,
    refit_estimate,
)
from molt_hpc.plan.lora import adapted_weights, adapter_params
from molt_hpc.plan.shape import shape_of
from molt_hpc.plan.trainer import Phase, TrainerMemory, trainer_memory

ALLOCATOR_SLACK = 1.08
"""Reserved over allocated bytes of PyTorch's caching allocator in a training step (expandable
segments keep it low); checked by `bench/plan.py`."""
CONTEXT_BYTES = 2.0 * GIB
"""CUDA context, cuBLAS workspaces and NCCL buffers on each trainer GPU: outside the allocator."""


@dataclass(frozen=True)
class Placement:
    """Where the pools run: Slurm het groups, or this machine's GPUs (local mode)."""

    mode: str
    actor_ranks: int
    actor_nodes: int
    actor_device: str
    engines: int
    engine_gpus: int
    engine_device: str
    shared_gpu: bool = False
    """Local mode with fewer GPUs than the pools ask for: the trainer and the engines share them."""

    @property
    def ranks_per_node(self) -> int:
        return math.ceil(self.actor_ranks / self.actor_nodes)


def placement_of(cfg: MoltConfig, local: bool, gpus: int | None = None) -> Placement:
    """The Slurm placement, or (`local`) this machine's with `gpus` visible GPUs (None: ask torch)."""
    act, eng, sl = cfg.actor, cfg.engines, cfg.slurm
    if cfg.run.stage != "rl":  # a supervised stage: the actor pool alone, on this machine's GPUs
        adev = _device(act.device, (gpus if gpus is not None else _visible_gpus()) > 0)
        return Placement("local", act.ranks, 1, adev, 0, 0, "none")
    if not local:
        agpu, egpu = sl.actor.gpus_per_node, sl.engines.gpus_per_node
        ranks = sl.actor.nodes * agpu if agpu else act.ranks
        # engines.count is per engine-pool node on Slurm, or the job's engines when one spans nodes
        engines = sl.engines.nodes * eng.count if eng.nodes_per_engine == 1 else eng.count
        return Placement("slurm", ranks, sl.actor.nodes, _device(act.device, agpu > 0),
                         engines, sl.engines.nodes * egpu, _device(eng.device, egpu > 0))  # fmt: skip
    if gpus is None:
        gpus = _visible_gpus()
    adev, edev = _device(act.device, gpus > 0), _device(eng.device, gpus > 0)
    want = (act.ranks if adev == "cuda" else 0) + (eng.count * eng.gpus_per_engine if edev == "cuda" else 0)
    shared = adev == edev == "cuda" and gpus < want
    return Placement("local", act.ranks, 1, adev, eng.count, eng.count * eng.gpus_per_engine, edev, shared)


def _device(setting: str, has_gpus: bool) -> str:
    return "cuda" if setting == "cuda" or (setting == "auto" and has_gpus) else "cpu"


def _visible_gpus() -> int:
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return len([g for g in env.split(",") if g.strip()])
    from molt_hpc.devices import device_gpu_count

    return device_gpu_count()


@dataclass
class Check:
    """One resource against its limit."""

    what: str
    need: float
    limit: float

    @property
    def ok(self) -> bool:
        return self.need <= self.limit


@dataclass
class Plan:
    cfg: MoltConfig
    arch: Arch
    placement: Placement
    trainer: TrainerMemory
    engines: EngineMemory
    refit: Refit
    refit_phase: Phase
    host: dict[str, float]
    """Host bytes per actor node by part."""
    checks: list[Check] = field(default_factory=list)
    blockers: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def runnable(self) -> bool:
        return self.fits and not self.blockers

    @property
    def blocker_names(self) -> list[str]:
        """Each blocker's subject (the text before its colon), for one-line verdicts."""
        return [b.split(":")[0] for b in self.blockers]

    @property
    def trainer_peak(self) -> Phase:
        return max([self.trainer.peak, self.refit_phase], key=lambda p: p.total)

    def check(self, what: str) -> Check:
        return next(c for c in self.checks if c.what == what)


def gpu_need(allocated: float) -> float:
    """Bytes of GPU memory a trainer rank needs for `allocated` bytes at its peak."""
    return allocated * ALLOCATOR_SLACK + CONTEXT_BYTES


def make_plan(cfg: MoltConfig, arch: Arch, *, local: bool = False, gpus: int | None = None) -> Plan:
    where = placement_of(cfg, local, gpus)
    gpu = cfg.plan.gpu_memory_gib * GIB
    trainer = trainer_memory(arch, shape_of(cfg, where.actor_ranks, where.actor_device, arch))
    engines = engine_memory(arch, cfg, where.engines, gpu)
    in_place = where.shared_gpu and where.actor_ranks == 1 and cfg.engines.kind == "builtin"
    refit = refit_estimate(arch, cfg, where.actor_ranks, where.actor_nodes, same_node=where.mode == "local",
                           device=where.actor_device, engine_device=where.engine_device, in_place=in_place)  # fmt: skip
    host = _host(arch, cfg, where, trainer)
    plan = Plan(cfg, arch, where, trainer, engines, refit, _refit_phase(arch, cfg, trainer), host)
    plan.checks = _checks(plan, gpu)
    plan.blockers = _shape_blockers(arch, cfg)
    return plan


def _refit_phase(arch: Arch, cfg: MoltConfig, trainer: TrainerMemory) -> Phase:
    """Rank 0 during a refit: its resident state, one whole tensor in the wire dtype and one bucket (a
    supervised stage has no refit: its checkpoint gathers one whole fp32 tensor at a time)."""
    b = 4 if cfg.model.dtype == "float32" else 2
    resident = {k: v for k, v in trainer.state.items() if k != "gradients"}
    if cfg.run.stage != "rl":
        return Phase("checkpoint (rank 0)", {**resident, "whole tensor": 4 * largest_tensor(arch)})
    if cfg.actor.lora is not None:  # the fp32 adapters alone, every one whole on rank 0
        adapters = 4.0 * adapter_params(arch, cfg.actor.lora)
        return Phase("refit (rank 0)", {**resident, "whole adapters": adapters,
                                        "refit bucket": float(min(cfg.refit.bucket_mb << 20, adapters))})  # fmt: skip
    bucket = float(min(cfg.refit.bucket_mb << 20, b * arch.params))
    return Phase("refit (rank 0)", {**resident, "whole tensor": b * largest_tensor(arch), "refit bucket": bucket})


def _host(arch: Arch, cfg: MoltConfig, where: Placement, trainer: TrainerMemory) -> dict[str, float]:
    """Host bytes per actor node: loading (each rank reads its own shard), offloaded state, a CPU trainer."""
    per_node = where.ranks_per_node
    out = {"loading (own shards)": per_node * 4 * arch.params / where.actor_ranks}
    for key, value in trainer.host.items():
        out[f"offloaded {key}"] = per_node * value
    if where.actor_device == "cpu":
        out["trainer on the CPU"] = per_node * trainer.peak.total
    if builtin_adapters(cfg) == "merged" and where.mode == "local" and where.engine_device == "cuda":
        # a builtin engine that merges keeps the base of every adapted weight in host memory (engine/lora.py)
        c = 4 if cfg.model.dtype == "float32" else 2
        out["engine: base of the adapted weights"] = where.engines * c * adapted_weights(arch, cfg.actor.lora)
    return out


SLURM_NODE_HOST_GIB = 1800.0
"""A Slurm node's host memory when `plan.host_memory_gib` is unset: a DGX H100/H200 node's 2 TB, less room
for the OS and the page cache."""


def host_limit(cfg: MoltConfig, where: Placement) -> float:
    """Host bytes per actor node the plan allows: `plan.host_memory_gib` when it is set; else, for a run on
    this machine, the memory it has, and for a Slurm job `SLURM_NODE_HOST_GIB`."""
    if cfg.plan.host_memory_gib is not None:
        return cfg.plan.host_memory_gib * GIB
    if where.mode == "local":
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    return SLURM_NODE_HOST_GIB * GIB


def _checks(plan: Plan, gpu: float) -> list[Check]:
    where, cfg, eng = plan.placement, plan.cfg, plan.engines
    host = host_limit(cfg, where)
    out = []
    if where.actor_device == "cuda":
        need = gpu_need(plan.trainer_peak.total)
        if where.shared_gpu:
            need += eng.used if eng.kind == "builtin" else eng.budget
        out.append(Check("trainer GPU", need, gpu))
    if where.engine_device == "cuda" and not where.shared_gpu:
        if eng.kind == "builtin":  # weights, sampling logits and a cache grown to max_batch full rows
            out.append(Check("engine GPU", eng.budget, gpu))
        else:  # vLLM refuses to start without KV cache for one max_model_len sequence
            one = eng.kv_bytes_per_token * eng.max_model_len
            out.append(Check("engine GPU", eng.weights + eng.other + one, eng.budget))
    load = plan.host.get("loading (own shards)", 0.0)
    steady = sum(v for k, v in plan.host.items() if not k.startswith("loading"))
    out.append(Check("host memory per actor node", max(load, steady), host))
    return out


def _shape_blockers(arch: Arch, cfg: MoltConfig) -> list[str]:
    act, eng = cfg.actor, cfg.engines
    out = []
    engines = cfg.run.stage == "rl"  # a supervised stage starts no engine
    if act.cp > 1 and arch.heads % act.cp:
        out.append(
            f"actor.cp = {act.cp} does not divide the model's {arch.heads} attention heads (Ulysses splits heads)"
        )
    if act.cp > 1 and arch.kv_heads % act.cp and act.cp % arch.kv_heads:
        out.append(f"actor.cp = {act.cp} and the model's {arch.kv_heads} KV heads: one must divide the other")
    if act.ep > 1 and not arch.is_moe:
        out.append(f"actor.ep = {act.ep} but {arch.model_type} has no experts: set actor.ep = 1")
    if act.ep > 1 and arch.is_moe and arch.experts % act.ep:
        out.append(f"actor.ep = {act.ep} does not divide the model's {arch.experts} experts")
    egpu = cfg.slurm.engines.gpus_per_node
    per_node = eng.count * eng.gpus_per_engine if eng.nodes_per_engine == 1 else eng.gpus_per_engine_node
    if engines and egpu and per_node > egpu:
        out.append(f"engines take {per_node} GPUs per engine node (count × tensor_parallel × data_parallel) but "
                   f"slurm.engines.gpus_per_node = {egpu}")  # fmt: skip
    if engines and eng.kind == "vllm" and not arch.mla and arch.heads % eng.tensor_parallel:
        out.append(f"engines.tensor_parallel = {eng.tensor_parallel} does not divide the {arch.heads} attention heads")
    return out
