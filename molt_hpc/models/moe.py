"""The MoE layout of a transformers model: its routers, their decoder-layer ids, their routing rule.

transformers 5 MoE blocks share one shape: a router module (`mlp.gate`, GPT-OSS's `mlp.router`)
returning `(router_logits [T, E], top_k_weights [T, K], top_k_index [T, K])` and an experts module.
The router class is the one the model itself records `router_logits` from (its
`_can_record_outputs`), so routers are found by class, whatever their attribute names. Both the
trainer (replay, freezing, aux losses) and the builtin engine (routing capture) read the layout here.
"""

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # importing this module needs no torch (the engine client reads the routing format)
    from torch import nn

SOFTMAX_TOP_K = {
    "Qwen3MoeTopKRouter": False,
    "Qwen2MoeTopKRouter": False,
    "Qwen3NextTopKRouter": False,
    "Qwen3VLMoeTextTopKRouter": False,
    "OlmoeTopKRouter": False,
    "FlexOlmoTopKRouter": False,
    "MixtralTopKRouter": True,
}
"""Router classes whose rule is softmax(logits) -> top-k -> (optional) renormalisation, which is what
router replay and routing capture implement; the value says whether the top-k weights are always
renormalised (otherwise the router's `norm_topk_prob` says). Other routers (GPT-OSS: top-k of the raw
logits; DeepSeek-V3: sigmoid, bias and groups) are found and frozen but cannot be replayed."""

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class Router:
    """One router of a model."""

    name: str
    """Its module path (`model.layers.3.mlp.gate`)."""
    layer: int
    """Its global decoder-layer id: the index of its rows on the layer axis of `routed_experts`."""
    module: "nn.Module"


def router_class(model: "nn.Module") -> type | None:
    """The router class of `model`, or None for a dense model.

    It is the class the model records `router_logits` from; a model that declares none (DeepSeek-V3 and
    GLM-4-MoE in transformers 5.17, Llama 4) has its router found by the MoE block's shape: the module
    next to the block's `experts` whose weight maps the hidden state to one logit per expert."""
    recorders = getattr(model, "_can_record_outputs", None) or {}
    target = recorders.get("router_logits")
    cls = getattr(target, "target_class", target)
    if isinstance(cls, type):
        return cls
    for block in model.modules():
        experts = getattr(block, "experts", None)
        count = _expert_count(experts)
        for name, child in block.named_children() if count else ():
            weight = getattr(child, "weight", None)
            if name != "experts" and getattr(weight, "ndim", 0) == 2 and weight.shape[0] == count:
                return type(child)
    return None


def _expert_count(experts) -> int:
    """Experts in an experts module (its `num_experts`, else the leading size of its 3-D weights); 0 if none."""
    if experts is None or not hasattr(experts, "parameters"):
        return 0
    count = getattr(experts, "num_experts", None)
    if isinstance(count, int):
        return count
    stacked = [p for p in experts.parameters(recurse=False) if p.ndim == 3]
    return int(stacked[0].shape[0]) if stacked else 0


def find_routers(model: "nn.Module") -> list[Router]:
    """Every router of `model` in layer order ([] for a dense model)."""
    cls = router_class(model)
    if cls is None:
        return []
    found = []
    for name, module in model.named_modules():
        if isinstance(module, cls):
            match = _LAYER.search(name)
            assert match, f"router {name} is not inside a decoder layer (`layers.N.`)"
            found.append(Router(name, int(match.group(1)), module))
    return sorted(found, key=lambda r: r.layer)


def num_layers(model: "nn.Module") -> int:
    """Decoder layers of the model: the layer axis of `routed_experts` (vLLM's `num_hidden_layers`)."""
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(text.num_hidden_layers)


def renormalises(router: "nn.Module") -> bool:
    """Whether `router`'s top-k weights are renormalised; a `ValueError` for a router whose rule is not
    softmax -> top-k (it cannot be replayed or captured)."""
    for cls in type(router).__mro__:
        if cls.__name__ in SOFTMAX_TOP_K:
            return SOFTMAX_TOP_K[cls.__name__] or bool(getattr(router, "norm_topk_prob", False))
    raise ValueError(
        f"router class {type(router).__name__} does not route by softmax -> top-k; router replay and routing "
        f"capture support {', '.join(sorted(SOFTMAX_TOP_K))}: set actor.router_replay = false for this model"
    )
