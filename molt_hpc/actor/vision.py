"""The trainer's image inputs: pixel values, patch grids and multimodal positions of a micro-batch.

A micro-batch (padded rows or packed ones) holds some of the step's samples; their images, in the
order their tokens appear row after row, are exactly the order in which the model's forward fills
image pads with features. Pixel values are computed here from the stored image bytes, with the
model directory's own image processor, once per distinct image per step (a group's samples share
their prompt's images), and their grids are checked against the ones the trace recorded.

FSDP runs the vision tower's shards as collectives: every rank must run it in every forward. A
micro-batch with no image (a text-only prompt, a rank's padding micro-batch) therefore gets one more
row holding a dummy image and nothing else: no sample, no action, so it changes no log-prob and
no gradient but keeps the ranks in step; the caller keeps the outputs of the original rows only.
"""

import dataclasses
import hashlib
import io

import torch
from torch import Tensor

from molt_hpc.actor.packing import FILL
from molt_hpc.algorithm import Experience
from molt_hpc.algorithm.experience import TOKEN_FIELDS
from molt_hpc.trajectory import TraceImage
from molt_hpc.vision.processor import Vision, pixel_inputs
from molt_hpc.vision.rope import rope_positions

DUMMY_SIDE = 28
"""Side of the dummy image: the smallest Qwen2-VL image (one merged patch)."""


def _dummy_png() -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (DUMMY_SIDE, DUMMY_SIDE)).save(out, format="PNG")
    return out.getvalue()


class ImageInputs:
    """Per-micro-batch image inputs of a vision-language policy (and its reference)."""

    def __init__(self, vision: Vision):
        self.vision = vision
        self._pixels: dict[bytes, Tensor] = {}
        data = _dummy_png()
        grid = vision.grid(data)
        self.dummy = TraceImage(data, 0, vision.tokens(grid), grid)

    def new_step(self) -> None:
        """Forget the previous step's pixel values."""
        self._pixels.clear()

    def _pixel_values(self, images: list[TraceImage]) -> tuple[Tensor, Tensor]:
        parts = []
        for im in images:
            key = hashlib.sha256(im.data).digest()
            if key not in self._pixels:
                self._pixels[key] = pixel_inputs(self.vision, [im])["pixel_values"]
            parts.append(self._pixels[key])
        return torch.cat(parts), torch.tensor([im.grid for im in images], dtype=torch.long)

    def inputs(self, mb: Experience) -> tuple[Experience, dict[str, Tensor]]:
        """(the micro-batch, with a dummy-image row when it has no image, and the model's image kwargs:
        `position_ids [3, B, T]`, `pixel_values`, `image_grid_thw`)."""
        assert mb.images is not None and mb.rope_position_ids is not None, "a VLM batch carries images"
        seq = mb.seq_index.flatten()
        order = torch.unique_consecutive(seq[seq >= 0]).tolist()
        images = [im for n in order for im in mb.images[n]]
        if not images:
            mb, images = self._with_dummy(mb), [self.dummy]
        pixels, grids = self._pixel_values(images)
        device = mb.sequences.device
        return mb, {
            "position_ids": mb.rope_position_ids.permute(2, 0, 1).to(device),
            "pixel_values": pixels.to(device),
            "image_grid_thw": grids.to(device),
        }

    def _with_dummy(self, mb: Experience) -> Experience:
        """`mb` with one more row: the dummy image's pads, then padding; no sample, no action."""
        b, t = mb.sequences.shape
        n = self.dummy.length
        width = max(t, n)
        grown = {}
        for name in TOKEN_FIELDS:
            x = getattr(mb, name)
            if x is None:
                continue
            out = torch.full((b + 1, width, *x.shape[2:]), FILL.get(name, 0), dtype=x.dtype, device=x.device)
            out[:b, :t] = x
            grown[name] = out
        grown["sequences"][b, :n] = self.vision.spec.image_token_id
        grown["position_ids"][b] = torch.arange(width)
        grown["position_ids"][:b, t:] = torch.arange(width - t)  # more padding: one more block apart
        rope = rope_positions(width, [self.dummy], self.vision.spec.merge)[0].T
        grown["rope_position_ids"][b] = rope
        grown["rope_position_ids"][:b, t:] = grown["position_ids"][:b, t:, None]
        return dataclasses.replace(mb, **grown)
