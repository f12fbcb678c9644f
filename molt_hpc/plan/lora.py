"""LoRA in the plan: how many adapter parameters `[actor.lora]` adds to a model of shape `Arch`.

Each adapted linear layer `in → out` gets A `[r, in]` and B `[out, r]`: `r · (in + out)` parameters.
Counted over the standard projections of each decoder block (attention q, k, v, o; a dense block's
MLP gate, up, down, an MoE block's shared expert; routed experts only when named), which are what the
default `target_modules` adapts; names outside these count nothing here (their adapters are small
beside the base either way).
"""

from molt_hpc.config.train import LoraConfig
from molt_hpc.plan.arch import Arch

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def _widths(arch: Arch, moe: bool) -> dict[str, list[tuple[int, int]]]:
    """(in, out) of each standard linear layer of one block, by its name (several for MoE experts)."""
    h, q, kv = arch.hidden, arch.heads * arch.head_dim, arch.kv_heads * arch.head_dim
    out = {"q_proj": [(h, q)], "k_proj": [(h, kv)], "v_proj": [(h, kv)], "o_proj": [(q, h)]}
    width = (arch.shared_intermediate if moe else arch.intermediate) or 0
    if width:
        out.update({"gate_proj": [(h, width)], "up_proj": [(h, width)], "down_proj": [(width, h)]})
    return out


def _adapted(arch: Arch, cfg: LoraConfig) -> list[tuple[int, int]]:
    """(in, out) of every linear layer `cfg` adapts, over all blocks."""
    names = set(cfg.target_modules) if cfg.target_modules is not None else set(ATTENTION + MLP)
    names = {n.rsplit(".", 1)[-1] for n in names}
    return [io for block in arch.blocks for name, layers in _widths(arch, block.moe).items() if name in names
            for io in layers]  # fmt: skip


def adapter_params(arch: Arch, cfg: LoraConfig) -> int:
    """Adapter parameters of the whole model under `cfg`: `r · (in + out)` per adapted layer."""
    return sum(cfg.rank * (i + o) for i, o in _adapted(arch, cfg))


def adapted_weights(arch: Arch, cfg: LoraConfig) -> int:
    """Elements of the base weights `cfg` adapts: what the builtin engine keeps a base copy of (in host memory)."""
    return sum(i * o for i, o in _adapted(arch, cfg))


def largest_adapter(arch: Arch, cfg: LoraConfig) -> int:
    """Elements of the largest adapter tensor (A or B)."""
    return max((cfg.rank * max(i, o) for i, o in _adapted(arch, cfg)), default=0)
