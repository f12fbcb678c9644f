"""Engine-pool memory per GPU (weights per TP rank, KV-cache capacity) and the refit's bytes and time.

vLLM takes `gpu_memory_utilization` of the GPU and fills what its weights, its profiling forward and
its CUDA graphs leave with KV cache; it refuses to start when that cache cannot hold one sequence of
`max_model_len` tokens. KV bytes per token are `layers · 2 · max(1, kv_heads / TP) · head_dim` in the
model dtype (one latent vector per layer for multi-head latent attention, on every TP rank). A vLLM
engine of `data_parallel × tensor_parallel` GPUs (on one node or `nodes_per_engine`) replicates
attention and the dense layers per data-parallel replica, split over its TP ranks, and splits the
routed experts over all its GPUs (whole experts under expert parallelism; vLLM's MoE layers shard
them over TP × DP without it); each replica keeps its own KV cache for its own sequences. The
built-in engine holds its weights and a dynamic cache that grows to `max_batch × max_model_len`.
"""

import math
from dataclasses import dataclass

from molt_hpc.config import MoltConfig
from molt_hpc.plan.arch import Arch

GIB = 2**30
VLLM_PROFILE_BYTES = 5.0 * GIB
"""vLLM's profiling-forward peak plus non-torch memory: 4.8–5.6 GiB measured for 0.6B–8B models on
H100 at default batch limits (it is set by the profile batch, not the model)."""
CUDA_GRAPH_BYTES = 1.0 * GIB
"""CUDA graph pools of a vLLM engine (0 with `engines.enforce_eager`)."""
BUCKET_LATENCY_S = 0.002
"""Fixed cost of one refit bucket (pause, call, load)."""


def dtype_bytes(cfg: MoltConfig) -> int:
    return 4 if cfg.model.dtype == "float32" else 2


@dataclass
class EngineMemory:
    """One engine GPU: its weights, what the engine takes besides, and the KV cache left."""

    kind: str
    engines: int
    gpus_per_engine: int
    weights: float
    other: float
    budget: float
    """Bytes the engine may use on one GPU (vLLM: gpu_memory_utilization × the GPU)."""
    kv_bytes_per_token: int
    max_model_len: int
    wanted_sequences: int
    """Sequences in flight per replica (groups_in_flight × n_samples over the engines' replicas)."""
    replicas: int = 1
    """Data-parallel replicas per engine, each with its own KV cache."""

    @property
    def kv_cache(self) -> float:
        return max(0.0, self.budget - self.weights - self.other)

    @property
    def kv_tokens(self) -> int:
        return int(self.kv_cache // self.kv_bytes_per_token)

    @property
    def full_sequences(self) -> int:
        """Sequences of max_model_len tokens the cache holds at once."""
        return self.kv_tokens // self.max_model_len

    @property
    def used(self) -> float:
        return self.weights + self.other + self.kv_cache


def engine_memory(arch: Arch, cfg: MoltConfig, engines: int, gpu_bytes: float) -> EngineMemory:
    eng, ro = cfg.engines, cfg.rollout
    b = dtype_bytes(cfg)
    if eng.kind == "vllm":
        tp, dp = eng.tensor_parallel, eng.data_parallel
        wanted = math.ceil(ro.groups_in_flight * ro.n_samples / max(1, engines * dp))
        other = VLLM_PROFILE_BYTES + (0.0 if eng.enforce_eager else CUDA_GRAPH_BYTES)
        return EngineMemory("vllm", engines, eng.gpus_per_engine, b * vllm_params_per_gpu(arch, tp, dp), other,
                            eng.gpu_memory_utilization * gpu_bytes, arch.kv_bytes_per_token(tp, b),
                            eng.max_model_len, wanted, dp)  # fmt: skip
    wanted = math.ceil(ro.groups_in_flight * ro.n_samples / max(1, engines))
    kv_token = arch.kv_bytes_per_token(1, b)
    cache = kv_token * eng.max_batch * eng.max_model_len
    logits = 4 * eng.max_batch * arch.vocab * 2  # fp32 sampling logits and their softmax
    weights = b * arch.params
    if builtin_adapters(cfg) == "separate":  # the engine's own fp32 LoRA layers beside the base
        from molt_hpc.plan.lora import adapter_params

        weights += 4 * adapter_params(arch, cfg.actor.lora)
    return EngineMemory("builtin", engines, 1, weights, logits, weights + logits + cache, kv_token,
                        eng.max_model_len, wanted)  # fmt: skip


def builtin_adapters(cfg: MoltConfig) -> str | None:
    """How a builtin engine holds a LoRA run's adapters (`actor.lora.engine_weights`: merged into its weights,
    or separate layers); None without LoRA or with vLLM engines."""
    if cfg.actor.lora is None or cfg.engines.kind != "builtin" or cfg.run.stage != "rl":
        return None
    return cfg.actor.lora.engine_weights or "merged"


def vllm_params_per_gpu(arch: Arch, tp: int, dp: int) -> float:
    """Parameters one GPU of a vLLM engine holds: the dense part over its replica's TP ranks, the routed
    experts over all `tp × dp` GPUs."""
    return (arch.params - arch.expert_params) / tp + arch.expert_params / (tp * dp)


@dataclass
class Refit:
    """One refit: bytes on the wire, and the time the links bound it to."""

    bytes: float
    buckets: int
    gather_s: float
    send_s: float
    merge_s: float = 0.0
    """A builtin engine's LoRA merge: the adapted weights' kept base copied back from host memory."""
    copy_s: float = 0.0
    """Engines on the trainer's GPU reading a world of one's parameters in place: no buckets, no link, one
    copy kernel per tensor (the fp32 master read, the wire dtype written) at the device's bandwidth."""

    @property
    def seconds(self) -> float:
        return self.gather_s + self.send_s + self.merge_s + self.copy_s + self.buckets * BUCKET_LATENCY_S


def refit_estimate(
    arch: Arch,
    cfg: MoltConfig,
    ranks: int,
    actor_nodes: int,
    same_node: bool,
    device: str = "cuda",
    engine_device: str = "cuda",
    in_place: bool = False,
) -> Refit:
    """Gather the shards (cast to the wire dtype) to rank 0, then broadcast to every engine worker; inside
    a node at the device profile's `refit_gb_per_s` (`plan.cuda` or `plan.cpu`), across nodes at
    `plan.network_gb_per_s`. A LoRA run sends its fp32 adapters alone; a builtin engine that merges them
    then copies the adapted weights' base back from host memory at `host_link_gb_per_s` (on a CPU engine: a
    copy in memory). `in_place`: built-in engines on the GPU of a trainer of one rank read its fp32 parameters
    where they are (`refit/shared_params.py`), a copy at `memory_gb_per_s`."""
    wire = dtype_bytes(cfg) * arch.params
    profile = getattr(cfg.plan, "cpu" if device == "cpu" else "cuda")
    if in_place and cfg.actor.lora is None:
        return Refit(wire, 0, 0.0, 0.0, copy_s=(4 * arch.params + wire) / (profile.memory_gb_per_s * 1e9))
    merge = 0.0
    if cfg.actor.lora is not None and cfg.run.stage == "rl":
        from molt_hpc.plan.lora import adapted_weights, adapter_params

        wire = 4 * adapter_params(arch, cfg.actor.lora)
        if builtin_adapters(cfg) == "merged":
            p = cfg.plan.cpu.memory_gb_per_s if engine_device == "cpu" else cfg.plan.cuda.host_link_gb_per_s
            merge = dtype_bytes(cfg) * adapted_weights(arch, cfg.actor.lora) / (p * 1e9)
    node_bw = profile.refit_gb_per_s
    gather_bw = node_bw if actor_nodes <= 1 else cfg.plan.network_gb_per_s
    send_bw = node_bw if same_node else cfg.plan.network_gb_per_s
    gather = wire * (ranks - 1) / ranks / (gather_bw * 1e9) if ranks > 1 else 0.0
    return Refit(wire, math.ceil(wire / (cfg.refit.bucket_mb << 20)), gather, wire / (send_bw * 1e9), merge)


def largest_tensor(arch: Arch) -> int:
    """Elements of the largest single parameter: what rank 0 holds whole during a refit or checkpoint."""
    expert_tensor = 0
    if arch.is_moe:  # fused gate_up_proj [E, 2I, H]
        expert_tensor = arch.experts * 2 * arch.moe_intermediate * arch.hidden
    return max(arch.vocab * arch.hidden, expert_tensor, arch.intermediate * arch.hidden)
