"""Pre-flight of `[actor.lora]`: peft is installed and the configured adapters fit the model.

The model is built on the meta device (no memory, no weights) and `molt_hpc.models.lora.target_names`
resolves the adapted layers exactly as the trainer will: a `target_modules` name that matches nothing,
or names a layer LoRA cannot adapt here, and a model without linear layers in its decoder blocks, each
fail here in one line (exit 2) instead of minutes into the run.
"""

import importlib.util
from pathlib import Path

from molt_hpc.config import ConfigError, MoltConfig


def _meta_model(cfg: MoltConfig):
    """The policy on the meta device, or None where it cannot be had before the run (builtin:smollm2's
    one-time conversion)."""
    import torch

    from molt_hpc.models.sharded import meta_model

    if not cfg.model.is_builtin:
        from molt_hpc.models.resolve import run_model

        return meta_model(run_model(Path(cfg.model.path), "policy"), critic=False, dtype=torch.float32, attn="sdpa")
    if cfg.model.path != "builtin:tiny-char":
        return None  # the other builtins are checked when the trainer builds them
    from transformers import AutoModelForCausalLM

    from molt_hpc.models.tiny_char import tiny_config

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(tiny_config(cfg.model.tiny))


def check_lora(cfg: MoltConfig, error: type[ConfigError]) -> None:
    """Raise `error` (one line: the key, what is wrong, the fix) when `[actor.lora]` cannot run as configured."""
    if cfg.actor.lora is None:
        return
    if importlib.util.find_spec("peft") is None:
        raise error("[actor.lora] builds its adapters with peft, which is not installed: pip install 'molt-hpc[lora]'")
    model = _meta_model(cfg)
    if model is None:
        return
    from molt_hpc.models.lora import target_names

    try:
        target_names(model, cfg.actor.lora)
    except ValueError as err:
        raise error(str(err)) from None
