"""LoRA adapters on a plain transformers model: which linear layers are adapted (`target_names`), peft's
injection of them (`inject`), and their names. The trainer (`actor.lora`) and a built-in engine that keeps
the adapters as separate layers (`actor.lora.engine_weights = 'separate'`, `engine.lora`) inject them alike,
so both compute the same ops.

Names: a parameter `model.layers.0.self_attn.q_proj.lora_A.default.weight` travels (refit) as
`model.layers.0.self_attn.q_proj.lora_A.weight` (`wire_name`; `live_name` goes back).
"""

import torch
from torch import nn

from molt_hpc.config.train import LoraConfig

ADAPTER = "default"
"""peft's adapter name inside the trainer (never saved: PEFT files drop it)."""


def is_adapter(name: str) -> bool:
    """Whether parameter `name` is a LoRA adapter's (A or B)."""
    return ".lora_A." in name or ".lora_B." in name


def wire_name(name: str) -> str:
    """A trainer adapter parameter's name without peft's adapter name (refits and saved files use it)."""
    return name.replace(f".lora_A.{ADAPTER}.", ".lora_A.").replace(f".lora_B.{ADAPTER}.", ".lora_B.")


def live_name(name: str) -> str:
    """The parameter an adapter tensor of a refit (`wire_name`) is in a model with injected adapters."""
    return name.replace(".lora_A.", f".lora_A.{ADAPTER}.").replace(".lora_B.", f".lora_B.{ADAPTER}.")


def _excluded(name: str, routers: set[str]) -> bool:
    """Experts and routers are adapted only when named (a fused expert is no linear layer anyway)."""
    return ".experts." in f".{name}." or name in routers


def target_names(model: nn.Module, cfg: LoraConfig) -> list[str]:
    """Full module paths of the linear layers `cfg` adapts in `model`; a `ValueError` naming the fix when
    a configured name matches none, or matches a layer peft cannot wrap here."""
    from molt_hpc.models.blocks import language_blocks
    from molt_hpc.models.moe import find_routers

    modules = dict(model.named_modules())
    if cfg.target_modules is None:
        routers = {r.name for r in find_routers(model)}
        inside = {id(m) for block in language_blocks(model) for m in block.modules()}
        names = [
            n for n, m in modules.items() if isinstance(m, nn.Linear) and id(m) in inside and not _excluded(n, routers)
        ]
        if not names:
            raise ValueError(
                f"{type(model).__name__} has no linear layer in its decoder blocks for LoRA to adapt; "
                "name the layers in actor.lora.target_modules"
            )
        return names
    names = []
    for target in cfg.target_modules:
        found = [n for n in modules if n == target or n.endswith("." + target)]
        if not found:
            sample = sorted({n.rsplit(".", 1)[-1] for n, m in modules.items() if isinstance(m, nn.Linear)})
            raise ValueError(
                f"actor.lora.target_modules: {target!r} matches no module of {type(model).__name__}; its linear "
                f"layers are named {', '.join(sample[:12])}"
            )
        bad = [n for n in found if not isinstance(modules[n], nn.Linear)]
        if bad:
            raise ValueError(
                f"actor.lora.target_modules: {target!r} names {bad[0]}, a {type(modules[bad[0]]).__name__}: LoRA "
                "here adapts linear layers only (nn.Linear); name linear layers instead"
            )
        names += [n for n in found if n not in names]
    return names


def peft_config(model: nn.Module, cfg: LoraConfig):
    """peft's `LoraConfig` for `model`: the explicit module paths of `target_names`."""
    import peft

    return peft.LoraConfig(
        r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=target_names(model, cfg),
        bias="none", init_lora_weights=True,
    )  # fmt: skip


def inject(model: nn.Module, cfg: LoraConfig) -> None:
    """Add the adapters to `model` in place (on the meta device too): base frozen, adapters fp32, trained."""
    import peft

    peft.inject_adapter_in_model(peft_config(model, cfg), model, adapter_name=ADAPTER)
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter(name))
    for module in model.modules():
        for attr in ("lora_A", "lora_B"):
            if isinstance(getattr(module, attr, None), nn.ModuleDict):
                getattr(module, attr).to(torch.float32)  # fp32 master adapters whatever the base's dtype
