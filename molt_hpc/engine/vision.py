"""The builtin engine's images: a request's `mm` field checked and turned into pixels, and a runner whose
prefill feeds them to a vision-language model with its multimodal (3-D) positions.

A request's `mm` is `{"images": [data URIs or base64], "spans": [[offset, length], ...]}`: `token_ids`
already hold every image's placeholders, expanded (token in, trace out), and each span says where.
Each span must be a run of image pads exactly as long as its image's token count under this engine's
image processor, and no pad may lie outside a span; anything else is a 400 naming the mismatch
(transformers would fail the forward with "Image features and image tokens do not match").

Prefill computes each row's positions with `molt_hpc.vision.rope` (left padding shifts nothing: a
padded row's positions start at its first real token) and places the image features itself, at the
spans: a row re-prefilled after a refit may hold an image pad it generated, which keeps its plain
embedding there, as it had in decode (transformers would count it as one more placeholder).
Decode needs no images: the scheduler gives each row's next position as `length - 1 + rope_delta`,
which transformers spreads over the three rotary axes. A VLM runs on this plain runner (the growing
cache), not the GPU slot cache, whose columns are position ids.

The samples of one prompt send the same images: `ImageCache` checks and processes them once, and a
row's `RowImages.key` (the images' bytes and spans) lets the scheduler prefill such rows in one forward.
"""

import base64
import binascii
import hashlib
import threading
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass

import torch
from torch import Tensor

from molt_hpc.engine.batch import ModelRunner
from molt_hpc.engine.kvcache import BatchCache
from molt_hpc.trajectory import TraceImage
from molt_hpc.vision.images import image_bytes
from molt_hpc.vision.rope import rope_positions


@dataclass
class RowImages:
    """A request's images as the prefill feeds them."""

    images: list[TraceImage]
    """Placed in the request's prompt (offsets into its token ids)."""
    pixel_values: Tensor
    image_grid_thw: Tensor
    rope_delta: int
    """Position shift of every token after the prompt's last image (see `molt_hpc.vision.rope`)."""
    key: tuple = ()
    """The images' places and a digest of their bytes: rows with the same context and key prefill alike."""


def _decode(ref: object, i: int) -> bytes:
    if not isinstance(ref, str):
        raise ValueError(f"mm.images[{i}] must be a data URI or base64 string")
    if not ref.startswith("data:"):
        try:
            ref = "data:image/png;base64," + base64.b64encode(base64.b64decode(ref, validate=True)).decode()
        except (binascii.Error, ValueError):
            raise ValueError(f"mm.images[{i}] is not base64 image bytes") from None
    try:
        return image_bytes(ref)
    except ValueError as err:
        raise ValueError(f"mm.images[{i}]: {err}") from None


def row_images(mm: object, token_ids: list[int], vision) -> RowImages:
    """The checked images of a request (`vision`: the served model's `Vision`); a `ValueError` says what is wrong."""
    if vision is None:
        raise ValueError("this engine serves a text model: a request with images (mm) needs a vision-language model")
    if not isinstance(mm, dict) or set(mm) != {"images", "spans"}:
        raise ValueError("mm must be {'images': [data URIs], 'spans': [[offset, length], ...]}")
    refs, spans = mm["images"], mm["spans"]
    if not isinstance(refs, list) or not isinstance(spans, list) or len(refs) != len(spans) or not refs:
        raise ValueError("mm.images and mm.spans must be lists of the same (non-zero) length")
    datas = [_decode(ref, i) for i, ref in enumerate(refs)]
    pixels, grids = vision.pixels(datas)
    pad, placed, end = vision.spec.image_token_id, [], 0
    for i, (span, data, grid) in enumerate(zip(spans, datas, grids.tolist(), strict=True)):
        ok = isinstance(span, list) and len(span) == 2 and all(isinstance(x, int) for x in span)
        offset, length = span if ok else (-1, -1)
        want = vision.tokens(tuple(grid))
        if not ok or offset < end or length != want or offset + length > len(token_ids):
            raise ValueError(
                f"mm.spans[{i}] = {span}: image {i} needs {want} placeholder tokens after offset {end} within the "
                f"{len(token_ids)} token ids (its patch grid is {grid})"
            )
        if any(t != pad for t in token_ids[offset : offset + length]):
            raise ValueError(f"mm.spans[{i}] = {span} covers tokens that are not the image pad ({pad})")
        placed.append(TraceImage(data, offset, length, tuple(grid)))
        end = offset + length
    if sum(1 for t in token_ids if t == pad) != sum(im.length for im in placed):
        raise ValueError(f"token_ids hold image pads ({pad}) outside mm.spans: every pad needs its image")
    _, delta = rope_positions(len(token_ids), placed, vision.spec.merge)
    key = tuple((im.offset, im.length, hashlib.sha256(im.data).digest()) for im in placed)
    return RowImages(placed, pixels, grids, delta, key)


class ImageCache:
    """`row_images` of the last `size` distinct requests (thread-safe): a group's samples arrive together with
    the same images and prompt, and decoding, resizing and measuring them once is enough (a few groups'
    worth is kept: a large image's pixel values are tens of MB). A request that arrives while its twin is
    being checked waits for that result. Only checked requests are kept; a bad one raises each time."""

    def __init__(self, vision, size: int = 16):
        self.vision, self.size = vision, size
        self._kept: OrderedDict[tuple, RowImages] = OrderedDict()
        self._pending: dict[tuple, Future] = {}
        self._lock = threading.Lock()

    def get(self, mm: object, token_ids: list[int]) -> RowImages:
        try:
            key = (tuple(mm["images"]), tuple(map(tuple, mm["spans"])), tuple(token_ids))  # type: ignore[index]
            hash(key)
        except (TypeError, KeyError):  # not the expected shape: row_images says what is wrong
            return row_images(mm, token_ids, self.vision)
        with self._lock:
            if (hit := self._kept.get(key)) is not None:
                self._kept.move_to_end(key)
                return hit
            if (twin := self._pending.get(key)) is None:
                self._pending[key] = mine = Future()
        if twin is not None:
            return twin.result()
        try:
            images = row_images(mm, token_ids, self.vision)
        except BaseException as err:  # the waiting twins get the same error, never a hang
            with self._lock:
                del self._pending[key]
            mine.set_exception(err)
            raise
        with self._lock:
            del self._pending[key]
            self._kept[key] = images
            while len(self._kept) > self.size:
                self._kept.popitem(last=False)
        mine.set_result(images)
        return images


def check_no_pads(token_ids: list[int], vision) -> None:
    """A prompt without images must hold no image pad: its features would be missing."""
    pad = vision.spec.image_token_id
    if pad in token_ids:
        raise ValueError(f"token_ids hold image pads ({pad}) but the request has no images (mm): send them")


class VisionRunner(ModelRunner):
    """A `ModelRunner` for vision-language models: prefill with pixel values and 3-D positions."""

    def __init__(self, model, device: torch.device, merge: int):
        super().__init__(model, device)
        self.merge = merge

    @torch.inference_mode()
    def prefill(self, contexts: list[list[int]], images: list[RowImages | None] | None = None):
        images = images or [None] * len(contexts)
        length = max(len(c) for c in contexts)
        ids = torch.zeros(len(contexts), length, dtype=torch.long)
        mask = torch.zeros(len(contexts), length, dtype=torch.long)
        positions = torch.zeros(3, len(contexts), length, dtype=torch.long)
        for i, (ctx, im) in enumerate(zip(contexts, images, strict=True)):
            ids[i, length - len(ctx) :] = torch.tensor(ctx)
            mask[i, length - len(ctx) :] = 1
            positions[:, i, length - len(ctx) :] = rope_positions(len(ctx), im.images if im else [], self.merge)[0]
        embeds = self.model.get_input_embeddings()(ids.to(self.device))
        with_images = [(i, im) for i, im in enumerate(images) if im is not None]
        if with_images:  # the features fill the prompts' spans only (a generated pad keeps its embedding)
            pixels = torch.cat([im.pixel_values for _, im in with_images]).to(self.device, embeds.dtype)
            grids = torch.cat([im.image_grid_thw for _, im in with_images]).to(self.device)
            feats = self.model.get_image_features(pixels, grids).pooler_output
            feats = torch.cat(list(feats)) if isinstance(feats, tuple | list) else feats
            at = torch.zeros(ids.shape, dtype=torch.bool)
            for i, im in with_images:
                shift = length - len(contexts[i])
                for placed in im.images:
                    at[i, shift + placed.offset : shift + placed.end] = True
            embeds[at.to(self.device)] = feats.to(embeds.dtype)
        cache = self._new_cache()
        out = self.model(
            inputs_embeds=embeds,
            attention_mask=mask.to(self.device),
            position_ids=positions.to(self.device),
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_kw: cache},
        )
        return out.logits[:, -1], BatchCache(cache, mask.to(self.device))
