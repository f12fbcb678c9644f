"""Images in a training batch (pure): which samples keep which images, and their rotary positions.

Token in, trace out holds for images too: a sample keeps its images' placeholder runs exactly as the
engine saw them, so the features the trainer computes fill the same tokens. Two samples cannot train:

- `vlm_truncation`: the row cut (`max_len`) would fall inside an image's placeholder run. Half an
  image's tokens match no features (transformers fails the forward; a hand-made fix would train on
  a context the engine never saw), so the sample is dropped, never trained.
- `media_token`: an action holds a vision token (an image pad the model generated). No image stands
  behind it, so it too would break the forward; the sample is dropped.

Images wholly past the cut leave with their tokens. A dropped sample becomes one padding token with
no action, so it counts in the batch (its reward stays in its group) and trains nothing.
"""

from collections.abc import Sequence

from torch import Tensor

from molt_hpc.trajectory import TraceImage, Trajectory
from molt_hpc.vision.rope import rope_positions
from molt_hpc.vision.spec import VisionSpec


def drop_reason(traj: Trajectory, cut: int, spec: VisionSpec) -> str | None:
    """Why `traj` cut at `cut` cannot train (`vlm_truncation`, `media_token`), or None."""
    media = spec.media_token_ids
    if any(not media.isdisjoint(traj.tokens[start:end]) for start, end in traj.action_ranges):
        return "media_token"
    if any(im.offset < cut < im.end for im in traj.images):
        return "vlm_truncation"
    return None


def kept_images(traj: Trajectory, cut: int) -> list[TraceImage]:
    return [im for im in traj.images if im.end <= cut]


def rope_rows(position_ids: Tensor, seq_index: Tensor, images: Sequence[Sequence[TraceImage]], merge: int) -> Tensor:
    """`[B, T, 3]` multimodal positions of a laid-out batch: each sample's from `molt_hpc.vision.rope`
    where it sits (its text positions restart at 0), the text positions copied on the three axes elsewhere."""
    out = position_ids[..., None].expand(*position_ids.shape, 3).clone()
    for n, ims in enumerate(images):
        if not ims:
            continue  # a text-only sample: its positions are its text positions on every axis
        rows, cols = (seq_index == n).nonzero(as_tuple=True)
        out[rows, cols] = rope_positions(len(cols), ims, merge)[0].T
    return out
