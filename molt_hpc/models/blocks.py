"""The repeated decoder blocks of an HF model, found from its own `_no_split_modules` (no model code forked)."""

from torch import nn


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of an HF model: modules whose class its `_no_split_modules` names."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    return [m for m in model.modules() if type(m).__name__ in names]


def language_blocks(model: nn.Module) -> list[nn.Module]:
    """The decoder blocks of the language model (a vision-language model's vision blocks left out)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    inside = {id(m) for m in decoder.modules()} if isinstance(decoder, nn.Module) else None
    return [b for b in decoder_blocks(model) if inside is None or id(b) in inside]
