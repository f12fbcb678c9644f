"""Loading any HF-layout model directory: checks with a fix for users, quiet transformers, local files only."""

from pathlib import Path

from molt_hpc.hf_logging import quiet_transformers


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


def lm_class(config):
    """The transformers auto class of a config: image-text-to-text for a vision-language model (a config
    with a `vision_config`, which `AutoModelForCausalLM` does not take), else causal LM."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if getattr(config, "vision_config", None) is not None else AutoModelForCausalLM


def pad_token_id(config) -> int:
    """The model's pad id: its own, else its text model's (transformers 5.17's vision-language configs keep
    it in `text_config` only, and raise on the attribute), else 0."""
    for part in (config, getattr(config, "text_config", None)):
        pad = getattr(part, "pad_token_id", None)
        if pad is not None:
            return int(pad)
    return 0


def load_causal_lm(path: str | Path, *, dtype: str = "float32", device: str = "cpu", attn: str = "sdpa"):
    """A transformers causal LM (or vision-language model) from an HF directory, in eval mode, on `device`."""
    import torch
    from transformers import AutoConfig

    quiet_transformers()
    check_model_dir(Path(path))
    config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    model = lm_class(config).from_pretrained(
        str(path), dtype=getattr(torch, dtype), attn_implementation=attn, local_files_only=True
    )
    return model.to(device).eval()
