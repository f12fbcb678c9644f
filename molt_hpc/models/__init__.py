"""Model kinds and where they come from: one home for every model molt-hpc builds, converts or loads.

- `load`: any HF-layout directory (checks, local files only, quiet transformers).
- `resolve`: `model.path` to a directory; the `builtin:` registry.
- `cache`: `build_once`, each builtin model built once per user and copied into the run's model cache,
  published atomically.
- `tiny_char`: `builtin:tiny-char`, the offline character-level Qwen3 the CPU demo and tests train.
- `tiny_vl`: `builtin:tiny-vl`, the offline tiny Qwen2-VL (tiny-char's tokenizer plus the vision tokens).
- `tiny_moe`: `builtin:tiny-moe`, the offline tiny Qwen3-MoE over the same tokenizer (router replay, EP).
- `gguf`: GGUF checkpoints from installed packages (`builtin:smollm2`), converted once to safetensors.
- `sharded`: the trainer's loading: a model built on the meta device, sharded, each rank reading only its
  slices of the safetensors files (`slices`: names, fused MoE experts, region reads).
- `blocks`: the repeated decoder blocks of a model (the language model's alone for a VLM).
- `moe`: the MoE layout of a transformers model (its routers, their decoder-layer ids, their routing rule).
- `router_replay`: the fp32 replay forward a MoE router gets in the trainer (`swap_routers`).
- `reward`: reward models (a one-label sequence-classification head, its score read at the last token).
- `exact`, `exact_attention`, `exact_blocks`: `engines.exact`'s batch-invariant forwards (linear layers,
  activations, attention as block matrix multiplies), applied to a plain transformers model by the engine and
  the trainer alike; `exact_linear`: its batch-invariant matrix multiply; `exact_moe`: its batch-invariant
  mixture-of-experts layers; `exact_cuda`: the fixed-tile triton multiply those run on a CUDA GPU;
  `exact_cuda_attention`: exact attention as one fused triton kernel on a GPU; `exact_norm`: RMSNorm's
  batch-invariant mean on a GPU.
- `lora`: LoRA adapters on a plain transformers model (which layers, peft's injection, their names), for the
  trainer and for a builtin engine that keeps them as separate layers.
- `teacher`: a distillation teacher (`distill.teacher`) resolved like `model.path`, and whether it reads the
  policy's token ids (the same tokenizer).
"""

from molt_hpc.hf_logging import quiet_transformers
from molt_hpc.models.cache import build_once
from molt_hpc.models.load import check_model_dir, load_causal_lm, load_tokenizer, pad_token_id
from molt_hpc.models.resolve import BUILTINS, resolve_model
from molt_hpc.models.tiny_char import SPECIALS, build_tiny, build_tiny_tokenizer
from molt_hpc.models.tiny_moe import build_tiny_moe

__all__ = [
    "BUILTINS",
    "SPECIALS",
    "build_once",
    "build_tiny",
    "build_tiny_moe",
    "build_tiny_tokenizer",
    "check_model_dir",
    "load_causal_lm",
    "load_tokenizer",
    "pad_token_id",
    "quiet_transformers",
    "resolve_model",
]
