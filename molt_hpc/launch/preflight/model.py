"""Pre-flight of a model directory the run loads (`model.path`, and a `distill.teacher` the same way): it
exists (a run directory: its latest checkpoint's policy), has a config, weights and a tokenizer that
transformers loads, and a vision-language model's image processor; a builtin name is known. Each failure
is one `PreflightError` line naming the key, what is wrong and the fix.
"""

from pathlib import Path
from typing import Any

from molt_hpc.config import MoltConfig
from molt_hpc.launch.preflight.files import PreflightError, where_read

WEIGHT_GLOBS = ("*.safetensors", "pytorch_model*.bin", "*.safetensors.index.json")


def is_vision(cfg: MoltConfig) -> bool:
    """Whether the configured model takes images (read from its config.json alone; no model is built)."""
    from molt_hpc.vision.spec import is_vision_model

    if cfg.model.is_builtin:
        return cfg.model.path == "builtin:tiny-vl"
    try:
        return is_vision_model(Path(cfg.model.path))
    except (OSError, ValueError):  # unreadable: check_model says what is wrong with the directory
        return False


def check_model(cfg: MoltConfig, original: str, cwd: Path, key: str = "model.path") -> tuple[Any, Any]:
    """(the tokenizer the run will use, when it can be had without building or converting a model; a
    vision-language model's `Vision`, else None) of `cfg.model.path`, which the config names as `key`."""
    from molt_hpc.models import BUILTINS

    path = cfg.model.path
    if cfg.model.is_builtin:
        if path not in BUILTINS:
            names = ", ".join(repr(n) for n in BUILTINS)
            raise PreflightError(f"{key} = {path!r} is not a builtin model: the builtin models are {names}")
        if path == "builtin:tiny-vl":  # tiny-char's tokenizer plus the vision tokens, and its image processor
            from molt_hpc.models.tiny_vl import build_tiny_vl_tokenizer, tiny_vl_vision

            return build_tiny_vl_tokenizer(), tiny_vl_vision(cfg.model.tiny_vl)
        if path != "builtin:smollm2":  # the other tiny models are built from a config with the tiny-char tokenizer
            from molt_hpc.models import build_tiny_tokenizer

            return build_tiny_tokenizer(), None
        from molt_hpc.models.gguf import SMOLLM2_DIST, find_package_gguf, require_gguf

        try:
            require_gguf()
            find_package_gguf(SMOLLM2_DIST)
        except ValueError as err:
            raise PreflightError(f"{key} = {path!r}: {err}") from None
        return None, None  # its tokenizer comes with the one-time conversion at the run's start
    from molt_hpc.models.resolve import run_model

    fix = "point it at a Hugging Face model directory (config.json, safetensors, tokenizer) or use builtin:tiny-char"
    try:
        model_dir = run_model(Path(path), "policy")  # a finished `molt-hpc sft` run: its latest policy
    except ValueError as err:
        raise PreflightError(f"{key} = {original!r}: {err}") from None
    if not model_dir.is_dir():
        raise PreflightError(f"{key} = {original!r}: {model_dir} does not exist{where_read(original, cwd)}; {fix}")
    if not (model_dir / "config.json").is_file():
        raise PreflightError(f"{key} = {original!r}: {model_dir} has no config.json; {fix}")
    if not any(next(model_dir.glob(g), None) for g in WEIGHT_GLOBS):
        raise PreflightError(f"{key} = {original!r}: {model_dir} has no weights (*.safetensors); {fix}")
    from transformers import AutoConfig

    from molt_hpc.models import load_tokenizer
    from molt_hpc.vision.processor import Vision

    try:
        AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
        tokenizer = load_tokenizer(model_dir)
    except Exception as err:  # transformers raises many kinds; the user needs the message, not the trace
        first = next(iter(str(err).strip().splitlines()), type(err).__name__)
        raise PreflightError(f"{key} = {original!r}: transformers cannot load {model_dir}: {first}") from None
    try:
        return tokenizer, Vision.of(model_dir)
    except Exception as err:  # a vision-language model without a loadable image processor
        first = next(iter(str(err).strip().splitlines()), type(err).__name__)
        raise PreflightError(f"{key} = {original!r}: its image processor does not load: {first}") from None


def check_vision(cfg: MoltConfig, vision: Any) -> None:
    """What a vision-language model cannot run with here, refused before anything starts."""
    if vision is None:
        return
    if cfg.algorithm.uses_critic:
        raise PreflightError(
            f"algorithm.advantage = {cfg.algorithm.advantage!r} trains a critic, which a vision-language model "
            f"({cfg.model.path}) has no value head for here: use a critic-free advantage (grpo, rloo, ...)"
        )
