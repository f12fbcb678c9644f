"""Building the trainer's models and optimizers: policy, frozen reference, critic, AdamW, LR schedule.

Every model is a plain transformers model loaded in fp32 (the master weights) on the CPU, with
dropout off (the engine samples without dropout; a ratio against its log-probs must compare like
with like). Weights are checked before anything is loaded, so a bad directory fails with a clear
error naming the file.
"""

import math
from pathlib import Path

import torch
from torch import nn

from molt_hpc.checkpoint import check_shapes, model_shapes
from molt_hpc.config.train import ActorConfig
from molt_hpc.models import check_model_dir, quiet_transformers
from molt_hpc.models.moe import find_routers


def disable_dropout(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0


def _check_weights(path: Path) -> None:
    check_model_dir(path)
    if any(path.glob("*.safetensors")):
        model_shapes(path)  # every header against its file size: a torn file is named before loading


def load_causal_lm(path: Path, attn: str, *, trainable: bool) -> nn.Module:
    """The policy (trainable) or the reference (frozen) from an HF directory, fp32, on the CPU."""
    from transformers import AutoModelForCausalLM

    quiet_transformers()
    _check_weights(path)
    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation=attn, local_files_only=True
    )
    disable_dropout(model)
    model.train(trainable)
    model.requires_grad_(trainable)
    return model


def load_critic(path: Path, attn: str, seed: int) -> nn.Module:
    """The policy's backbone with a scalar value head (token classification, one label), from `path`.

    From the policy's directory the head is new (initialised from `seed`); from a critic checkpoint
    it is loaded.
    """
    from transformers import AutoModelForTokenClassification

    quiet_transformers()
    _check_weights(path)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForTokenClassification.from_pretrained(
            str(path), num_labels=1, dtype=torch.float32, attn_implementation=attn, local_files_only=True
        )
    disable_dropout(model)
    return model.train()


def expected_shapes(base: Path, *, critic: bool = False) -> dict[str, tuple[int, ...]]:
    """Parameter name → shape of the model in `base`, built on the meta device (no memory, no weights)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

    quiet_transformers()
    config = AutoConfig.from_pretrained(str(base), local_files_only=True)
    if critic:
        config.num_labels = 1
    cls = AutoModelForTokenClassification if critic else AutoModelForCausalLM
    with torch.device("meta"):
        model = cls.from_config(config)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def check_checkpoint_model(model_dir: Path, base: Path, *, critic: bool = False) -> None:
    """Refuse a checkpointed model whose tensors differ from the configured model's."""
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
    params = [p for p in model.parameters() if p.requires_grad]
    # On GPUs the fused kernel updates all tensors in a few launches (torch's default takes many per step).
    fused = bool(params) and all(p.device.type == "cuda" for p in params)
    return torch.optim.AdamW(params, lr=lr, betas=cfg.betas, weight_decay=cfg.weight_decay, fused=fused or None)


def build_scheduler(opt: torch.optim.Optimizer, cfg: ActorConfig, total_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg, total_steps))
