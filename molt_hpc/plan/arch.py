"""The model's shape for the plan: its HF config, and exact parameter counts from a meta-device build.

No weights are read: the transformers class is built on the meta device from the config alone and its
parameters are counted per decoder block (dense part, routed experts, router) and outside the blocks
(embeddings, final norm, LM head: the FSDP root group). A vision-language model's blocks are its language
model's; its vision tower counts with the parameters outside them. The same build says whether the
trainer's log-probs take the fused path (`molt_hpc.actor.head`'s static rule, applied to the built model).
Where the config comes from:

- `builtin:tiny-char`, `builtin:tiny-moe`, `builtin:tiny-vl`: built from their spec (`model.tiny`,
  `model.tiny_moe`, `model.tiny_vl`), as the model is;
- a readable `model.path`: its `config.json`; `model.architecture`, when also set, must agree with it;
- otherwise `model.architecture` (the shapes shipped in `configs/models/` for models whose weights
  live on a cluster).
"""

import dataclasses
import json
import os
from pathlib import Path

from molt_hpc.config.model import ModelConfig
from molt_hpc.plan.arch_types import Arch, Block

ROUTER_SUFFIXES = (".gate.weight", ".router.weight")  # MoE routers (`mlp.gate`), not the MLP's `gate_proj`


def load_hf_config(model: ModelConfig):
    """(transformers config of the policy, where it came from). Raises ValueError with the fix."""
    from molt_hpc.models.resolve import builtin_config

    if model.is_builtin and (config := builtin_config(model)) is not None:
        return config, f"the {model.path} spec"
    path = config_file(model)
    return _config_from_file(path), str(path)


def config_file(model: ModelConfig) -> Path:
    """The `config.json` that gives the shape of a policy that is not built from a spec: `model.path`'s (a
    finished `molt-hpc sft` run directory: its latest policy's), checked against `model.architecture` when
    both are set, else `model.architecture`. Raises ValueError with the fix."""
    from molt_hpc.models.resolve import run_model

    own = None if model.is_builtin else run_model(Path(model.path).expanduser(), "policy") / "config.json"
    if own is not None and own.is_file():
        if model.architecture:
            _check_agrees(_arch_file(model.architecture), own)
        return own
    if model.architecture:
        return _arch_file(model.architecture)
    hint = "set model.architecture to its HF config.json to plan a model whose weights are elsewhere (configs/models/)"
    if own is None:
        raise ValueError(f"the plan needs the shape of model.path = {model.path}: {hint}")
    missing = "does not exist" if not own.parent.exists() else "has no config.json"
    raise ValueError(f"model.path {own.parent} {missing}; point it at an HF model directory, or {hint}")


def _arch_file(text: str) -> Path:
    path = Path(text).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"model.architecture = {text!r}: no such config.json (give the file or its directory)")
    return path


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not a readable config.json: {err}") from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise ValueError(f"{path}: a Hugging Face config.json names its model_type; this one does not")
    return data


def _config_from_file(path: Path):
    from transformers import CONFIG_MAPPING

    data = _read_json(path)
    kind = data["model_type"]
    if kind not in CONFIG_MAPPING:
        raise ValueError(f"{path}: model_type {kind!r} is not a model this transformers knows")
    return CONFIG_MAPPING[kind].from_dict({k: v for k, v in data.items() if not k.startswith("_")})


def _check_agrees(arch_path: Path, own: Path) -> None:
    """Every field of the architecture file must equal model.path's, or the plan describes another model."""
    want, have = _read_json(arch_path), _read_json(own)
    skip = {"_comment", "_source", "architectures", "transformers_version", "torch_dtype", "dtype"}
    wrong = [k for k, v in want.items() if k not in skip and k in have and have[k] != v]
    if wrong:
        diffs = ", ".join(f"{k}: {want[k]!r} vs {have[k]!r}" for k in wrong[:4])
        raise ValueError(
            f"model.architecture ({arch_path}) and model.path ({own}) describe different models ({diffs}): "
            "point model.architecture at this model's shape, or remove it"
        )


def arch_of(model: ModelConfig) -> Arch:
    """The `Arch` of the configured policy: shapes from its config; counts in closed form for the common
    families (`molt_hpc.plan.closed_form`, read from `config.json` without importing transformers), else
    from a meta-device build."""
    from molt_hpc.models.resolve import builtin_config
    from molt_hpc.plan.closed_form import closed_form_arch

    if model.is_builtin and (config := builtin_config(model)) is not None:
        source = f"the {model.path} spec"
        return closed_form_arch(config.to_dict(), source) or arch_from_config(config, source)
    path = config_file(model)
    return closed_form_arch(_read_json(path), str(path)) or arch_from_config(_config_from_file(path), str(path))


def arch_cached(model: ModelConfig, path: Path) -> Arch:
    """`arch_of(model)`, kept in `path` (JSON) once computed: a run's model does not change, and building
    it on the meta device costs seconds of imports that `molt-hpc status` should not pay each time. The
    file is written when the directory is writable (a run of one's own) and read whoever wrote it."""
    if path.is_file():
        data = json.loads(path.read_text())
        return Arch(**{**data, "blocks": tuple(Block(**b) for b in data["blocks"])})
    arch = arch_of(model)
    if os.access(path.parent, os.W_OK):
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(dataclasses.asdict(arch)))
        tmp.replace(path)  # atomic: a reader sees the whole file or none
    return arch


def arch_from_config(config, source: str = "") -> Arch:
    """Count a transformers config's parameters on the meta device (no memory, no weights)."""
    import torch

    from molt_hpc.actor.head import qualifies_statically
    from molt_hpc.hf_logging import quiet_transformers
    from molt_hpc.models.blocks import language_blocks
    from molt_hpc.models.load import lm_class

    quiet_transformers()
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    with torch.device("meta"):
        model = lm_class(config).from_config(config)
    blocks = language_blocks(model)
    if not blocks:
        raise ValueError(f"{type(model).__name__} names no decoder block class; the plan counts per block")
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    root = sum(p.numel() for p in _unique(model.parameters()) if id(p) not in in_blocks)
    heads = text.num_attention_heads
    return Arch(
        model_type=text.model_type,
        vocab=text.vocab_size,
        hidden=text.hidden_size,
        layers=len(blocks),
        heads=heads,
        kv_heads=getattr(text, "num_key_value_heads", None) or heads,
        head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
        intermediate=getattr(text, "intermediate_size", 0) or 0,
        tied=_tied(model),
        root_params=root,
        blocks=tuple(_block(b) for b in blocks),
        experts=_first(text, "num_experts", "num_local_experts", "n_routed_experts"),
        top_k=_first(text, "num_experts_per_tok", "moe_topk"),
        moe_intermediate=_first(text, "moe_intermediate_size"),
        shared_intermediate=_shared_width(text),
        kv_lora_rank=_first(text, "kv_lora_rank"),
        q_lora_rank=_first(text, "q_lora_rank"),
        qk_rope_head_dim=_first(text, "qk_rope_head_dim"),
        qk_nope_head_dim=_first(text, "qk_nope_head_dim"),
        v_head_dim=_first(text, "v_head_dim"),
        qk_norm=any(".q_norm." in f".{n}" for n, _ in blocks[0].named_parameters()),
        # the trainer's own rule on the same class; its one-position check at the first forward needs
        # values, so a head the static rule admits is taken as fused
        fused_head=qualifies_statically(model),
        source=source,
    )


def _tied(model) -> bool:
    """Whether the LM head is the input embedding (a VLM's flag sits on its outer config, not the text one)."""
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    return head is not None and embed is not None and head.weight is embed.weight


def _block(block) -> Block:
    named = dict(block.named_parameters())
    experts = sum(p.numel() for n, p in named.items() if ".experts." in f".{n}" and "shared" not in n)
    router = sum(p.numel() for n, p in named.items() if f".{n}".endswith(ROUTER_SUFFIXES))
    return Block(params=sum(p.numel() for p in named.values()), experts=experts, router=router)


def _unique(params):
    return {id(p): p for p in params}.values()


def _first(config, *names: str) -> int:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 0


def _shared_width(config) -> int:
    if _first(config, "shared_expert_intermediate_size"):
        return config.shared_expert_intermediate_size
    shared = _first(config, "n_shared_experts")
    return shared * _first(config, "moe_intermediate_size")
