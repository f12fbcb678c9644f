"""`Vision`: what every process needs to know about a vision-language model's images.

It reads the model directory once: the vision token ids and the spatial merge size from
`config.json`, and the image processor from `preprocessor_config.json` (`AutoImageProcessor`; with no
torchvision installed, as on CPUs here, transformers picks the PIL backend). `AutoProcessor` is never
used: on a CPU it needs torchvision for the video processor, so placeholders are expanded here, by
the rule every Qwen2-VL implementation shares (an image's tokens = t·h·w / merge²).
"""

import io
from pathlib import Path

import torch
from torch import Tensor

from molt_hpc.trajectory import TraceImage
from molt_hpc.vision.spec import VisionSpec, is_vision_model, vision_spec

__all__ = ["Vision", "VisionSpec", "is_vision_model", "pixel_inputs", "vision_spec"]


class Vision:
    """A VLM directory's image processor and `VisionSpec`: grids, placeholder counts and pixel values."""

    def __init__(self, model_dir: str | Path):
        from transformers import AutoImageProcessor

        from molt_hpc.hf_logging import quiet_transformers

        quiet_transformers()
        self.spec = vision_spec(model_dir)
        if not (Path(model_dir) / "preprocessor_config.json").is_file():
            raise ValueError(
                f"{model_dir} has no preprocessor_config.json: a vision-language model needs its image processor"
            )
        self.processor = AutoImageProcessor.from_pretrained(str(model_dir), local_files_only=True)

    @classmethod
    def from_parts(cls, spec: VisionSpec, processor) -> "Vision":
        """A `Vision` from its spec and an image processor already built (no model directory needed)."""
        vision = cls.__new__(cls)
        vision.spec, vision.processor = spec, processor
        return vision

    @classmethod
    def of(cls, model_dir: str | Path) -> "Vision | None":
        """The `Vision` of a VLM directory; None for a text model."""
        return cls(model_dir) if is_vision_model(model_dir) else None

    def pixels(self, images: list[bytes]) -> tuple[Tensor, Tensor]:
        """(`pixel_values [patches, C·t·p·p]`, `image_grid_thw [n, 3]`) of encoded images, in order."""
        from PIL import Image

        pil = []
        for data in images:
            with Image.open(io.BytesIO(data)) as im:
                pil.append(im.convert("RGB"))
        out = self.processor(images=pil, return_tensors="pt")
        return out["pixel_values"], out["image_grid_thw"].long()

    def grid(self, data: bytes) -> tuple[int, int, int]:
        """(t, h, w) patch grid of one encoded image."""
        return tuple(int(x) for x in self.pixels([data])[1][0])  # type: ignore[return-value]

    def tokens(self, grid: tuple[int, int, int]) -> int:
        """Placeholder tokens of an image with this patch grid."""
        t, h, w = grid
        return t * h * w // self.spec.merge**2

    def expand(self, ids: list[int], images: list[bytes]) -> tuple[list[int], list[TraceImage]]:
        """Each image pad of `ids` (one per image, in order) repeated to its image's token count; the
        images placed at their runs (offsets relative to `ids`). A count mismatch is a `ValueError`."""
        pad = self.spec.image_token_id
        found = sum(1 for t in ids if t == pad)
        if found != len(images):
            raise ValueError(
                f"the chat template wrote {found} image placeholder(s) for {len(images)} image(s): give one image "
                "part ({'type': 'image'} or an <image> mark) per image"
            )
        out: list[int] = []
        placed: list[TraceImage] = []
        it = iter(images)
        for t in ids:
            if t != pad:
                out.append(t)
                continue
            data = next(it)
            grid = self.grid(data)
            n = self.tokens(grid)
            placed.append(TraceImage(data, len(out), n, grid))
            out += [pad] * n
        return out, placed


def pixel_inputs(vision: Vision, images: list[TraceImage]) -> dict[str, Tensor]:
    """`pixel_values` and `image_grid_thw` of `images` for a forward; a grid that differs from the one
    recorded when the image's tokens were placed is a `ValueError` (a changed image processor)."""
    pixels, grids = vision.pixels([im.data for im in images])
    want = torch.tensor([im.grid for im in images], dtype=torch.long).reshape(-1, 3)
    if not torch.equal(grids, want):
        raise ValueError(
            f"the image processor gives grids {grids.tolist()} where the trace recorded {want.tolist()}: the "
            "model's preprocessor_config.json changed since these images were tokenised"
        )
    return {"pixel_values": pixels, "image_grid_thw": grids}
