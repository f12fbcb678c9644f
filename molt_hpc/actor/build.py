"""Building the trainer's models and optimizers: policy, frozen reference, critic, AdamW, LR schedule.

Every model is a plain transformers model built on the meta device, sharded by `parallelize`, and
filled with this rank's slices of the safetensors files (`molt_hpc.models.sharded`): no rank ever
holds a whole model. Dropout is off (the engine samples without dropout; a ratio against its
log-probs must compare like with like). Weights are checked before anything is loaded, so a bad
directory fails with a clear error naming the file.

Parameter dtypes: the policy and the critic keep fp32 master weights (they train), except a LoRA
policy's frozen base, kept in `model.dtype` beside its fp32 adapters (`molt_hpc.actor.lora`); the frozen
reference is stored in `model.dtype`, the dtype its forward computes in anyway, so `bfloat16`
halves its memory with the same log-probs as an fp32 copy cast at every forward (and a CPU run with
the default `float32` keeps fp32).
"""

import math
import time
from pathlib import Path
from typing import Literal

import torch
from torch import nn

from molt_hpc.actor import lora
from molt_hpc.actor.moe_router import prepare_routers
from molt_hpc.actor.offload import OptimizerOffload
from molt_hpc.actor.state import Trainable
from molt_hpc.actor.world import World
from molt_hpc.checkpoint import check_shapes, model_shapes
from molt_hpc.config import MoltConfig
from molt_hpc.config.train import ActorConfig
from molt_hpc.hf_logging import quiet_transformers
from molt_hpc.log import get_logger
from molt_hpc.models import check_model_dir
from molt_hpc.models.exact import make_exact
from molt_hpc.models.lora import inject
from molt_hpc.models.moe import find_routers
from molt_hpc.models.sharded import load_sharded
from molt_hpc.parallel import parallelize
from molt_hpc.parallel.attention import DocumentAttention

Role = Literal["policy", "reference", "critic", "reward"]


def disable_dropout(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0


def check_weights(path: Path) -> None:
    """A clear error, naming the file, for a directory that is not a loadable HF model."""
    check_model_dir(path)
    if any(path.glob("*.safetensors")):
        model_shapes(path)  # every header against its file size: a torn file is named before loading


def load_model(
    path: Path,
    cfg: MoltConfig,
    world: World,
    role: Role,
    documents: DocumentAttention | None = None,
    adapter: Path | None = None,
) -> nn.Module:
    """The policy, the frozen reference, the critic (a one-label value head on the same backbone) or a
    reward model (a one-label sequence-classification head: `molt-hpc rm train`) from the HF directory
    `path`, sharded over `world` (a collective: every rank calls it), with
    document attention (packed rows, CP) where `documents` says so.

    A critic built from the policy's directory gets a new head initialised from `run.seed`, the
    same at any rank count; from a critic checkpoint the head is loaded.

    Under `[actor.lora]` the policy is the base in `path` (stored in `model.dtype`, frozen) with
    adapters (`molt_hpc.actor.lora`) read from the PEFT directory `adapter`, or fresh from `run.seed`.
    """
    check_weights(path)
    quiet_transformers()
    act, trainable = cfg.actor, role != "reference"
    compute = getattr(torch, cfg.model.dtype)
    lora_policy = role == "policy" and act.lora is not None
    adapters = None
    if lora_policy:
        adapters = lora.saved_value(adapter) if adapter is not None else lora.fresh_value(cfg.run.seed)

    def prepare(model: nn.Module) -> None:  # on the meta device, before anything is allocated
        disable_dropout(model)
        model.train(trainable)
        model.requires_grad_(trainable)
        prepare_routers(model, cfg, role)  # fp32 (replay) routers, before parallelize gives each its fp32 unit
        if role == "policy" and act.freeze_router:
            freeze_router(model)
        if lora_policy:
            inject(model, act.lora)  # adapters fp32 and trained, the base frozen
        if role == "policy" and cfg.engines.exact:  # the engines' batch-invariant forwards (models/exact.py)
            make_exact(model)
        parallelize(model, world.mesh, act, compute_dtype=compute, documents=documents)

    t0 = time.perf_counter()
    model, stats = load_sharded(
        path, shard=prepare, device=torch.device("cpu") if act.offload == "full" else world.device,
        buffer_device=world.device, dtype=compute if role == "reference" or lora_policy else torch.float32,
        attn=cfg.model.attn_implementation, critic=role == "critic", seed=cfg.run.seed, reward=role == "reward",
        adapters=adapters,
    )  # fmt: skip
    get_logger().info(
        "%s from %s: this rank read %.3f of %.3f GB (%.0f%%) in %.1fs", role, path, stats.bytes_read / 1e9,
        stats.bytes_total / 1e9, 100 * stats.fraction, time.perf_counter() - t0,
    )  # fmt: skip
    return model


def expected_shapes(base: Path, *, critic: bool = False) -> dict[str, tuple[int, ...]]:
    """Parameter name → shape of the model in `base`, built on the meta device (no memory, no weights)."""
    from transformers import AutoConfig, AutoModelForTokenClassification

    from molt_hpc.models.load import lm_class

    quiet_transformers()
    config = AutoConfig.from_pretrained(str(base), local_files_only=True)
    if critic:
        config.num_labels = 1
    cls = AutoModelForTokenClassification if critic else lm_class(config)
    with torch.device("meta"):
        model = cls.from_config(config)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def check_checkpoint_model(model_dir: Path, base: Path, *, critic: bool = False, lora_policy: bool = False) -> None:
    """Refuse a checkpointed model whose tensors differ from the configured model's (a LoRA adapter
    directory's tensors are checked against the configured adapters when they are loaded)."""
    adapter = (model_dir / lora.CONFIG_FILE).is_file()
    if adapter != lora_policy:
        held, wanted = ("LoRA adapters", "without") if adapter else ("a full model", "with")
        raise ValueError(
            f"{model_dir} holds {held} but this run is configured {wanted} [actor.lora]: resume it with the "
            "[actor.lora] it was saved with, or use a new run.name"
        )
    if adapter:
        return
    check_shapes(model_dir, expected_shapes(base, critic=critic))


def freeze_router(model: nn.Module) -> list[str]:
    """Stop training MoE router parameters (a train/inference consistency guard); returns their names.

    Routers are found by class (`molt_hpc.models.moe.router_class`), so GPT-OSS's `mlp.router` (weight
    and bias) and Llama 4's `feed_forward.router` are frozen too and no dense MLP's `gate_proj` ever is."""
    names = []
    for router in find_routers(model):
        for name, p in router.module.named_parameters():
            p.requires_grad_(False)
            names.append(f"{router.name}.{name}")
    return names


def lr_factor(step: int, cfg: ActorConfig, total_steps: int) -> float:
    """Multiplier of the peak LR for the update of 0-based training step `step`: warm-up, then decay."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return 1.0
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
    floor = cfg.min_lr_ratio
    if cfg.lr_schedule == "linear":
        return 1.0 - (1.0 - floor) * progress
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_optimizer(model: nn.Module, cfg: ActorConfig, lr: float) -> torch.optim.Optimizer:
    """AdamW over the trained parameters; under `actor.offload = "optimizer"` on GPUs its state moves to
    pinned host memory between steps (on a CPU trainer it is in host memory already: nothing to do)."""
    params = [p for p in model.parameters() if p.requires_grad]
    # On GPUs the fused kernel updates all tensors in a few launches (torch's default takes many per step);
    # under full offload the parameters are on the host and the fused CPU kernel is the fast one.
    on_gpu = bool(params) and all(p.device.type == "cuda" for p in params)
    fused = on_gpu or (bool(params) and cfg.offload == "full")
    opt = torch.optim.AdamW(params, lr=lr, betas=cfg.betas, weight_decay=cfg.weight_decay, fused=fused or None)
    if cfg.offload == "optimizer" and on_gpu:
        OptimizerOffload(opt, params[0].device)
    return opt


def build_scheduler(opt: torch.optim.Optimizer, cfg: ActorConfig, total_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg, total_steps))


def trainable(name: str, model: nn.Module, cfg: MoltConfig, lr: float) -> Trainable:
    """`model` with its AdamW (at `lr`) and its schedule over `run.steps`, saved under `name`."""
    opt = build_optimizer(model, cfg.actor, lr)
    return Trainable(name, model, opt, build_scheduler(opt, cfg.actor, cfg.run.steps))
