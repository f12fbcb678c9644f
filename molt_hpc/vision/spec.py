"""A vision-language model's token ids and merge size, read from its `config.json` (no torch, no transformers:
the vLLM engine process reads it too)."""

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class VisionSpec:
    """The token ids and the merge size of a vision-language model (pure data: no processor)."""

    image_token_id: int
    """The placeholder (image pad) token one image's features replace, repeated per image token."""
    media_token_ids: frozenset[int]
    """Tokens only images and videos may produce (pads, vision start/end): never an action."""
    merge: int
    """Spatial merge size: merge² patches make one image token."""


def is_vision_model(model_dir: str | Path) -> bool:
    """Whether the HF directory holds a vision-language model (its config has a `vision_config`); False
    when it has no config.json (whoever loads it reports that)."""
    path = Path(model_dir) / "config.json"
    return path.is_file() and isinstance(json.loads(path.read_text()).get("vision_config"), dict)


def vision_spec(model_dir: str | Path) -> VisionSpec:
    return spec_from_config(json.loads((Path(model_dir) / "config.json").read_text()), str(model_dir))


def spec_from_config(config: dict, where: str = "the model") -> VisionSpec:
    """The `VisionSpec` of a vision-language model's config (the `config.json` mapping)."""
    vision = config.get("vision_config") or {}
    if "image_token_id" not in config or "spatial_merge_size" not in vision:
        raise ValueError(
            f"{where}: a vision-language model must name its image_token_id and vision_config.spatial_merge_size "
            "(Qwen2-VL and Qwen2.5-VL checkpoints do)"
        )
    media = [
        config.get(k) for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    ]
    return VisionSpec(int(config["image_token_id"]), frozenset(int(m) for m in media if m is not None),
                      int(vision["spatial_merge_size"]))  # fmt: skip
