"""LoRA refits in the builtin engine: the adapters arrive, and the engine merges them into its weights
(`AdapterMerge`) or writes them into LoRA layers of its own (`AdapterLayers`, `actor.lora.engine_weights =
'separate'`).

A LoRA refit (`update_info.lora_scaling` = alpha / rank) names adapter tensors only, by wire name
(`model.layers.0.self_attn.q_proj.lora_A.weight`, `...lora_B.weight`). The engine keeps the base
value of each adapted weight from its first LoRA refit (in pinned host memory when the weights are on a
GPU, so the GPU holds the base once) and at every refit sets `W = W_base + scaling · B·A`, computed in
fp32 from the base it kept and cast once to the weight's dtype: each refit starts from the same base
(no drift), and decoding then costs exactly what the base model's costs. A weight adapted before and
not in this refit goes back to its base.

The base goes back to the GPU in its own dtype, straight into the live weight, and the fp32 sum is made
there: a blocking copy that also changes dtype converts on the host first, and from pageable memory it
ran at 0.04 GB/s (19 s a refit for an 8B model with every linear layer adapted).
"""

import math

import torch

from molt_hpc.config.train import LoraConfig
from molt_hpc.models.lora import inject, is_adapter, live_name
from molt_hpc.refit.buckets import TensorMeta

SUFFIXES = (".lora_A.weight", ".lora_B.weight")


def target_of(name: str) -> str | None:
    """The weight an adapter tensor changes (`q_proj.lora_A.weight` → `q_proj.weight`), None for another name."""
    for suffix in SUFFIXES:
        if name.endswith(suffix):
            return name.removesuffix(suffix) + ".weight"
    return None


class AdapterMerge:
    """The kept base values and the received adapters of one engine's weights `params` (HF name → live tensor)."""

    def __init__(self, params: dict[str, torch.Tensor]):
        self.params = params
        self.base: dict[str, torch.Tensor] = {}
        """Each adapted weight's base value, kept from the first LoRA refit that named it."""
        self.adapters: dict[str, torch.Tensor] = {}

    def check(self, metas: list[TensorMeta], scaling: float) -> str | None:
        """Why the adapters `metas` cannot be merged into these weights, or None when they can."""
        shapes = {m.name: m.shape for m in metas}
        for m in metas:
            target = target_of(m.name)
            if target is None:
                return f"a LoRA refit sends adapters only (*{SUFFIXES[0]}, *{SUFFIXES[1]}), not {m.name}"
            if target not in self.params:
                return f"adapter {m.name} changes {target}, which this model does not have"
            pair = (
                m.name.replace(".lora_A.", ".lora_B.")
                if ".lora_A." in m.name
                else m.name.replace(".lora_B.", ".lora_A.")
            )
            if pair not in shapes:
                return f"adapter {m.name} came without {pair}"
            a, b = (m.shape, shapes[pair]) if ".lora_A." in m.name else (shapes[pair], m.shape)
            w = tuple(self.params[target].shape)
            if len(a) != 2 or len(b) != 2 or (b[0], a[1]) != w or a[0] != b[1]:
                return f"adapter {m.name}: B {list(b)} · A {list(a)} does not give {target}'s shape {list(w)}"
        return None

    def buffers(self, metas: list[TensorMeta]) -> dict[str, torch.Tensor]:
        """Where the adapters of `metas` are received (fp32 on the weights' device, kept across refits)."""
        out = {}
        for m in metas:
            device = self.params[target_of(m.name)].device
            have = self.adapters.get(m.name)
            if have is None or tuple(have.shape) != m.shape or have.device != device:
                self.adapters[m.name] = torch.empty(m.shape, dtype=torch.float32, device=device)
            out[m.name] = self.adapters[m.name]
        for name in set(self.adapters) - set(out):
            del self.adapters[name]
        return out

    @torch.no_grad()
    def apply(self, scaling: float) -> int:
        """Set every adapted weight to `W_base + scaling · B·A` (the others back to their base); returns the count."""
        targets = {target_of(n) for n in self.adapters}
        for target in sorted(targets):
            w = self.params[target]
            if target not in self.base:
                self.base[target] = keep(w)
            prefix = target.removesuffix(".weight")
            a, b = self.adapters[prefix + SUFFIXES[0]], self.adapters[prefix + SUFFIXES[1]]
            w.copy_(self.base[target], non_blocking=True)  # same dtype: a plain DMA from pinned memory
            w.copy_(torch.addmm(w.float(), b, a, alpha=scaling))  # W_base exactly in fp32, then one rounding
        for target in set(self.base) - targets:  # adapted before, not now: the base again
            self.params[target].copy_(self.base[target], non_blocking=True)
        if any(w.is_cuda for w in self.params.values()):
            torch.cuda.synchronize()
        return len(targets)


class AdapterLayers:
    """The adapters as separate LoRA layers of the engine's model (`models.lora.inject`, as the trainer's): a
    refit receives the fp32 adapters straight into those layers' parameters and the base never changes, so
    the engine computes each adapted layer as the trainer does (bf16 base output plus the fp32 adapters')."""

    def __init__(self, params: dict[str, torch.Tensor], scaling: float):
        self.params = params
        self.scaling = scaling
        """The layers' `alpha / rank`, set when they were injected: a refit must bring the same."""

    def check(self, metas: list[TensorMeta], scaling: float) -> str | None:
        """Why the adapters `metas` cannot be received into these layers, or None when they can."""
        if not math.isclose(scaling, self.scaling, rel_tol=1e-6):
            return f"update_info.lora_scaling = {scaling}, but this engine's LoRA layers scale by {self.scaling}"
        for m in metas:
            live = self.params.get(live_name(m.name)) if is_adapter(m.name) else None
            if live is None:
                return f"a LoRA refit sends this engine's adapters only (*{SUFFIXES[0]}, *{SUFFIXES[1]}), not {m.name}"
            if tuple(live.shape) != m.shape:
                return f"adapter {m.name} is {list(m.shape)}, this engine's LoRA layer {list(live.shape)}"
        return None

    def buffers(self, metas: list[TensorMeta]) -> dict[str, torch.Tensor]:
        """The live adapter parameters, by the names the refit sends."""
        return {m.name: self.params[live_name(m.name)] for m in metas}

    def apply(self, scaling: float) -> int:
        """Nothing to do: the adapters were received in place. Returns the count of adapted layers."""
        return sum(".lora_A." in name for name in self.params)


def keep(w: torch.Tensor) -> torch.Tensor:
    """A copy of `w` in its dtype: in pinned host memory when `w` is on a GPU, beside it otherwise."""
    if not w.is_cuda:
        return w.detach().clone()
    return torch.empty(w.shape, dtype=w.dtype, pin_memory=True).copy_(w.detach())


def prepare(model: torch.nn.Module, cfg: LoraConfig) -> float | None:
    """Ready a LoRA run's engine model for its refits, before any runner sees it. Separate adapters: LoRA
    layers injected as the trainer injects them (B = 0: version 0 is the base), frozen; returns their
    `alpha / rank`. Merged: an adapted LM head tied to the embeddings gets a weight of its own; None."""
    if cfg.engine_weights == "separate":
        inject(model, cfg)
        model.requires_grad_(False)  # refits write the adapters in place; the engine never trains
        return cfg.alpha / cfg.rank
    untie_adapted_head(model, cfg.target_modules)
    return None


def untie_adapted_head(model: torch.nn.Module, target_modules: list[str] | None) -> bool:
    """Give the LM head a weight of its own when LoRA adapts it and it is tied to the input embeddings
    (the trainer's adapter changes the output projection only); before any runner sees the weights.
    Returns whether it untied."""
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    if head is None or embed is None or head.weight is not embed.weight or not target_modules:
        return False
    path = next(name for name, m in model.named_modules() if m is head)
    if not any(path == t or path.endswith("." + t) for t in target_modules):
        return False
    head.weight = torch.nn.Parameter(head.weight.detach().clone(), requires_grad=False)
    model.config.get_text_config().tie_word_embeddings = False
    return True
