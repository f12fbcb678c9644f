"""Parameter counts of the common decoder families from their config fields alone: no transformers, no torch.

Building a model on the meta device (`molt_hpc.plan.arch.arch_from_config`) imports transformers' modeling
stack and torch, seconds of every plan that runs before a launch or a submission. For the families below
the counts are sums of layer shapes, written out here from their modeling code: q/k/v/o projections (with
the family's biases), Qwen3's per-head q/k norms, the gated MLP (or, in an MoE block, the router, the
routed experts and Qwen2-MoE's shared expert and its gate), two RMSNorms per block; embeddings, the final
norm and an untied LM head outside the blocks. A test holds every count to the meta-device build of the
same config (`tests/test_plan_closed_form.py`), so a transformers release that changes a shape is caught.

A config that leaves a field to its class default where the families' defaults differ (the number of KV
heads, Qwen3's head width) is not counted here: the caller falls back to the meta-device build.
"""

from molt_hpc.plan.arch_types import Arch, Block

DENSE = {"llama", "mistral", "qwen2", "qwen3"}
MOE = {"qwen2_moe", "qwen3_moe"}
FAMILIES = DENSE | MOE
QK_NORM = {"qwen3", "qwen3_moe"}
SHAPE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads")  # fmt: skip
MOE_KEYS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")


def closed_form_arch(data: dict, source: str = "") -> Arch | None:
    """The `Arch` of an HF config's fields (`config.json`, or a transformers config's `to_dict()`), or None
    when its family or the fields it gives are not ones counted here."""
    kind = data.get("model_type")
    if "num_experts" not in data and "num_local_experts" in data:  # Qwen3-MoE's saved name of the same field
        data = {**data, "num_experts": data["num_local_experts"]}
    if kind not in FAMILIES or not all(isinstance(data.get(k), int) for k in SHAPE_KEYS):
        return None
    if kind in MOE and not all(isinstance(data.get(k), int) for k in MOE_KEYS):
        return None
    if kind == "qwen2_moe" and not isinstance(data.get("shared_expert_intermediate_size"), int):
        return None
    head_dim = _head_dim(kind, data)
    if head_dim is None:
        return None
    hidden, vocab, heads, kv = (
        data["hidden_size"],
        data["vocab_size"],
        data["num_attention_heads"],
        data["num_key_value_heads"],
    )
    tied = bool(data.get("tie_word_embeddings", False))
    blocks = tuple(_block(kind, data, i, head_dim) for i in range(data["num_hidden_layers"]))
    moe = kind in MOE
    return Arch(
        model_type=kind,
        vocab=vocab,
        hidden=hidden,
        layers=len(blocks),
        heads=heads,
        kv_heads=kv or heads,
        head_dim=head_dim,
        intermediate=data["intermediate_size"],
        tied=tied,
        root_params=vocab * hidden * (1 if tied else 2) + hidden,
        blocks=blocks,
        experts=data["num_experts"] if moe and data["num_experts"] > 0 else 0,
        top_k=data["num_experts_per_tok"] if moe and data["num_experts_per_tok"] > 0 else 0,
        moe_intermediate=data["moe_intermediate_size"] if moe and data["moe_intermediate_size"] > 0 else 0,
        shared_intermediate=max(0, data.get("shared_expert_intermediate_size", 0)) if kind == "qwen2_moe" else 0,
        qk_norm=kind in QK_NORM,
        fused_head=True,  # a bias-free linear head, applied as it is, with `logits_to_keep`: every family here
        source=source,
    )


def _head_dim(kind: str, data: dict) -> int | None:
    given = data.get("head_dim")
    if isinstance(given, int):
        return given
    if kind in QK_NORM:  # Qwen3's class default (128) is not hidden / heads: left to the meta build
        return None
    return data["hidden_size"] // data["num_attention_heads"]


def _attention(kind: str, data: dict, head_dim: int) -> int:
    hidden, q, kv = data["hidden_size"], data["num_attention_heads"] * head_dim, data["num_key_value_heads"] * head_dim
    weights = hidden * (q + 2 * kv) + q * hidden
    if kind in ("llama", "qwen3", "qwen3_moe"):
        bias = q + 2 * kv + hidden if data.get("attention_bias", False) else 0
    elif kind == "qwen2":
        bias = q + 2 * kv  # q, k and v always carry a bias, o never
    elif kind == "qwen2_moe":
        bias = q + 2 * kv if data.get("qkv_bias", True) else 0
    else:  # mistral
        bias = 0
    norms = 2 * head_dim if kind in QK_NORM else 0
    return weights + bias + norms


def _mlp(kind: str, data: dict, width: int) -> int:
    hidden = data["hidden_size"]
    bias = 2 * width + hidden if kind == "llama" and data.get("mlp_bias", False) else 0
    return 3 * hidden * width + bias


def _sparse(kind: str, data: dict, layer: int) -> bool:
    if kind not in MOE or data["num_experts"] <= 0:
        return False
    only_mlp = data.get("mlp_only_layers") or []
    return layer not in only_mlp and (layer + 1) % data.get("decoder_sparse_step", 1) == 0


def _block(kind: str, data: dict, layer: int, head_dim: int) -> Block:
    hidden = data["hidden_size"]
    fixed = _attention(kind, data, head_dim) + 2 * hidden  # the two RMSNorms around attention and the MLP
    if not _sparse(kind, data, layer):
        return Block(params=fixed + _mlp(kind, data, data["intermediate_size"]))
    experts = data["num_experts"] * 3 * hidden * data["moe_intermediate_size"]
    router = data["num_experts"] * hidden
    shared = 0
    if kind == "qwen2_moe":  # a gated MLP beside the experts, and its one-output gate
        shared = _mlp(kind, data, data["shared_expert_intermediate_size"]) + hidden
    return Block(params=fixed + router + experts + shared, experts=experts, router=router)
