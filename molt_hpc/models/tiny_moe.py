"""`builtin:tiny-moe`: the offline tiny mixture-of-experts model.

A random-init Qwen3-MoE (8 experts, top-2 by default, a few M parameters) over the tiny-char
character tokenizer, saved in HF layout with safetensors, so router replay, MoE auxiliary losses
and expert parallelism run on a CPU through the real transformers and vLLM code paths. The head
size is one vLLM's attention kernels take (64 or 128), so a GPU can serve it as is. Checkpoints
keep per-expert names (`mlp.experts.{e}.gate_proj.weight`); transformers fuses them on load.
"""

from pathlib import Path

from molt_hpc.config.model import TinyMoeConfig
from molt_hpc.hf_logging import quiet_transformers
from molt_hpc.models.tiny_char import build_tiny_tokenizer, save_tiny


def tiny_moe_config(spec: TinyMoeConfig, tokenizer, dtype: str = "float32"):
    """The `Qwen3MoeConfig` of `spec` for `tokenizer`'s vocabulary."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        num_experts=spec.num_experts,
        num_experts_per_tok=spec.top_k,
        moe_intermediate_size=spec.moe_intermediate_size,
        intermediate_size=spec.intermediate_size,
        mlp_only_layers=sorted(set(spec.dense_layers)),
        decoder_sparse_step=1,
        norm_topk_prob=True,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        dtype=dtype,
    )


def build_tiny_moe(out_dir: str | Path, spec: TinyMoeConfig, *, dtype: str = "float32") -> Path:
    """Write the tiny MoE model (weights from `spec.init_seed`) and its tokenizer to `out_dir`.

    `dtype` is the saved dtype; the weights are drawn in fp32 either way, so a bf16 copy is the
    rounded fp32 model."""
    import torch
    from transformers import AutoModelForCausalLM

    quiet_transformers()
    out = Path(out_dir)
    tokenizer = build_tiny_tokenizer()
    config = tiny_moe_config(spec, tokenizer, dtype)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.init_seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.to(getattr(torch, dtype))
    return save_tiny(model, tokenizer, out)
