"""Per-expert HF names for the fused expert weights of transformers 5 MoE layers.

transformers 5 holds a layer's experts as two 3-D parameters, `mlp.experts.gate_up_proj [E, 2I, H]`
(gate rows, then up rows) and `mlp.experts.down_proj [E, H, I]`; Hub checkpoints and vLLM also know
them per expert: `mlp.experts.{e}.gate_proj.weight [I, H]`, `.up_proj.weight [I, H]`,
`.down_proj.weight [H, I]` (vLLM loads either form). A refit of expert-parallel weights sends them per
expert, so a bucket never needs a layer's experts whole; the built-in engine loads them into views of
its fused parameters. Layouts other than this one (transposed, interleaved or biased experts, as
GPT-OSS has) keep their fused names.
"""

import torch
from torch import nn

SPLIT = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
"""Fused parameter → its per-expert HF matrices, in the order they are stacked along dim 0."""


def experts_modules(model: nn.Module) -> list[nn.Module]:
    """The MoE experts modules of `model`: those transformers' `@use_experts_implementation` decorated."""
    return [m for m in model.modules() if is_experts_module(m)]


def is_experts_module(m: nn.Module) -> bool:
    return hasattr(m, "is_transposed") and hasattr(m, "has_gate") and isinstance(getattr(m, "num_experts", None), int)


def splittable(m: nn.Module) -> bool:
    """Whether an experts module has the layout whose per-expert names `expert_pieces` writes."""
    return (
        is_experts_module(m)
        and m.has_gate
        and getattr(m, "is_concatenated", True)
        and not m.is_transposed
        and not m.has_bias
    )


def expert_pieces(name: str, expert: int, matrix: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The per-expert HF tensors (views) of one expert's slice `matrix` of fused parameter `name`."""
    prefix, leaf = name.rsplit(".", 1)
    parts = SPLIT[leaf]
    return [(f"{prefix}.{expert}.{hf}.weight", t) for hf, t in zip(parts, matrix.chunk(len(parts)), strict=True)]


def expert_views(model: nn.Module) -> dict[str, torch.Tensor]:
    """Per-expert HF name → a view into the live fused parameter, for every splittable experts module."""
    out = {}
    for mod_name, m in model.named_modules():
        if not splittable(m):
            continue
        for leaf in SPLIT:
            p = getattr(m, leaf)
            for e in range(m.num_experts):
                out.update(expert_pieces(f"{mod_name}.{leaf}", e, p.data[e]))
    return out
