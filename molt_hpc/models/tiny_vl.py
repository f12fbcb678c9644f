"""`builtin:tiny-vl`: the offline tiny vision-language model (a random-init Qwen2-VL).

The tokenizer is tiny-char's plus Qwen2-VL's four vision tokens (`<|vision_start|>`, `<|vision_end|>`,
`<|image_pad|>`, `<|video_pad|>`), with a ChatML template that writes one
`<|vision_start|><|image_pad|><|vision_end|>` per image part of a message, as Qwen2-VL's own does.
The image processor is the PIL one (no torchvision on a CPU); it is saved as `Qwen2VLImageProcessor`,
so a GPU node with torchvision (vLLM) loads the same settings into its own backend. Head sizes are 64
in both towers, a size vLLM's attention kernels serve, so the same directory runs on vLLM. Nothing here
reaches a hub.
"""

from pathlib import Path

from molt_hpc.config.model import TinyVLModelConfig
from molt_hpc.hf_logging import quiet_transformers
from molt_hpc.models.tiny_char import build_tiny_tokenizer, save_tiny

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] in ('image', 'image_url') %}<|vision_start|><|image_pad|><|vision_end|>{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PATCH = 14
MERGE = 2


def build_tiny_vl_tokenizer():
    """tiny-char's tokenizer with the vision tokens added as specials and the image-aware template."""
    tokenizer = build_tiny_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_image_processor(tiny: TinyVLModelConfig):
    from transformers import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(
        min_pixels=tiny.min_pixels, max_pixels=tiny.max_pixels, patch_size=PATCH, merge_size=MERGE
    )


def tiny_vl_config(tiny: TinyVLModelConfig, tokenizer):
    """The `Qwen2VLConfig` of `builtin:tiny-vl` over `tokenizer` (`build_tiny_vl_tokenizer`): no weights."""
    from transformers import Qwen2VLConfig

    ids = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in VISION_TOKENS}
    head_dim = tiny.hidden_size // tiny.num_heads
    unit = head_dim // 16  # mRoPE splits the rotary half of a head over (t, h, w) as 2:3:3 (Qwen2-VL's 16:24:24)
    return Qwen2VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": tiny.hidden_size,
            "intermediate_size": tiny.intermediate_size,
            "num_hidden_layers": tiny.num_layers,
            "num_attention_heads": tiny.num_heads,
            "num_key_value_heads": tiny.num_kv_heads,
            "max_position_embeddings": tiny.max_position_embeddings,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [2 * unit, 3 * unit, 3 * unit],
            },
            "pad_token_id": tokenizer.pad_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "bos_token_id": None,
        },
        vision_config={
            "depth": tiny.vision_depth,
            "embed_dim": tiny.vision_embed_dim,
            "hidden_size": tiny.hidden_size,
            "num_heads": tiny.vision_embed_dim // 64,
            "mlp_ratio": 2,
            "patch_size": PATCH,
            "spatial_merge_size": MERGE,
            "temporal_patch_size": 2,
        },
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        dtype="float32",
    )


def tiny_vl_vision(tiny: TinyVLModelConfig):
    """The `Vision` of `builtin:tiny-vl` (its spec and image processor) without building the model."""
    from molt_hpc.vision.processor import Vision
    from molt_hpc.vision.spec import spec_from_config

    config = tiny_vl_config(tiny, build_tiny_vl_tokenizer()).to_dict()
    return Vision.from_parts(spec_from_config(config, "builtin:tiny-vl"), build_image_processor(tiny))


def build_tiny_vl(out_dir: str | Path, tiny: TinyVLModelConfig) -> Path:
    """Write the tiny VLM (weights from `tiny.init_seed`), its tokenizer and image processor to `out_dir`."""
    import torch
    from transformers import AutoModelForImageTextToText

    quiet_transformers()
    out = Path(out_dir)
    tokenizer = build_tiny_vl_tokenizer()
    config = tiny_vl_config(tiny, tokenizer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(tiny.init_seed)
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    save_tiny(model, tokenizer, out)
    build_image_processor(tiny).save_pretrained(out)
    return out
