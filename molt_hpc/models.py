"""Model sources: the offline tiny model and loading any HF-layout directory.

`builtin:tiny-char` is a character-level tokenizer (one token per printable ASCII character plus
four specials, ChatML chat template) and a random-init Qwen3 whose vocabulary is exactly the
tokenizer's, saved in HF layout with safetensors. Every other part of molt-hpc loads it the way it
would load a real checkpoint, so the tiny model exercises the real code paths. Nothing here ever
reaches a hub: loads pass `local_files_only`.
"""

import hashlib
import json
import os
import shutil
import string
import tempfile
from pathlib import Path

from molt_hpc.config.model import ModelConfig, TinyModelConfig

SPECIALS = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def quiet_transformers() -> None:
    """No per-shard progress bars or advisory warnings from transformers in our logs."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def build_tiny_tokenizer():
    """The character-level tokenizer, wrapped as a `PreTrainedTokenizerFast`."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for ch in string.printable:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIALS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        pad_token="<pad>",
        eos_token="<|im_end|>",
        bos_token=None,
        chat_template=CHAT_TEMPLATE,
        padding_side="left",
    )


def build_tiny(out_dir: str | Path, tiny: TinyModelConfig) -> Path:
    """Write the tiny model (weights from `tiny.init_seed`) and its tokenizer to `out_dir`."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, Qwen3Config

    quiet_transformers()
    out = Path(out_dir)
    tokenizer = build_tiny_tokenizer()
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=tiny.hidden_size,
        intermediate_size=tiny.intermediate_size,
        num_hidden_layers=tiny.num_layers,
        num_attention_heads=tiny.num_heads,
        num_key_value_heads=tiny.num_kv_heads,
        head_dim=tiny.hidden_size // tiny.num_heads,
        max_position_embeddings=tiny.max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(tiny.init_seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, top_k=0, do_sample=True
    )
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def resolve_model(cfg: ModelConfig, cache_dir: str | Path) -> Path:
    """The HF directory for `cfg.path`; a builtin model is built once into `cache_dir` (atomically)."""
    if not cfg.is_builtin:
        path = Path(cfg.path).expanduser()
        check_model_dir(path)
        return path
    if cfg.path == "builtin:smollm2":
        from molt_hpc.model_sources import resolve_smollm2

        return resolve_smollm2(cache_dir)
    if cfg.path != "builtin:tiny-char":
        raise ValueError(
            f"model.path = {cfg.path!r}: the only builtin models are 'builtin:tiny-char' and 'builtin:smollm2'"
        )
    key = hashlib.sha256(json.dumps(cfg.tiny.model_dump(), sort_keys=True).encode()).hexdigest()[:12]
    final = Path(cache_dir) / f"tiny-char-{key}"
    if (final / "config.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=final.parent))
    build_tiny(tmp, cfg.tiny)
    try:
        os.rename(tmp, final)
    except OSError:  # another process published the same deterministic model first
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def check_model_dir(path: Path) -> None:
    """A clear error when `path` is not an HF model directory."""
    if not path.exists():
        raise ValueError(
            f"model.path {path} does not exist; point it at an HF model directory or use builtin:tiny-char"
        )
    if not (path / "config.json").is_file():
        raise ValueError(f"model.path {path} has no config.json; it is not a Hugging Face model directory")


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    quiet_transformers()
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def load_causal_lm(path: str | Path, *, dtype: str = "float32", device: str = "cpu", attn: str = "sdpa"):
    """A transformers causal LM from an HF directory, in eval mode, on `device`."""
    import torch
    from transformers import AutoModelForCausalLM

    quiet_transformers()
    check_model_dir(Path(path))
    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=getattr(torch, dtype), attn_implementation=attn, local_files_only=True
    )
    return model.to(device).eval()
