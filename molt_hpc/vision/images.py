"""Image references to encoded bytes: what a dataset row, an env or a request may give.

A reference is a path (relative to a base directory, the data file's for dataset rows), a `file://`
URL, a `data:image/...;base64,...` URI, a bare base64 string, raw bytes, or a PIL image. The bytes are
kept as they are (a PNG stays the same PNG), so the engines and the trainer decode exactly the same
image; a PIL image is encoded as PNG once. Nothing is fetched over a network.
"""

import base64
import binascii
import io
from pathlib import Path
from typing import Any

# Magic numbers of the formats PIL reads that datasets carry.
SIGNATURES = {b"\x89PNG\r\n\x1a\n": "png", b"\xff\xd8\xff": "jpeg", b"GIF8": "gif", b"RIFF": "webp", b"BM": "bmp"}


def image_format(data: bytes) -> str | None:
    """`png`, `jpeg`, ... from the bytes' signature, or None when they are not an image file."""
    return next((fmt for sig, fmt in SIGNATURES.items() if data.startswith(sig)), None)


def _from_base64(text: str) -> bytes | None:
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        return None
    return data if image_format(data) else None


def image_bytes(ref: Any, base_dir: Path | None = None) -> bytes:
    """The encoded bytes of image reference `ref`; a `ValueError` saying what is wrong with it."""
    if isinstance(ref, bytes | bytearray | memoryview):
        data = bytes(ref)
    elif isinstance(ref, dict) and ("bytes" in ref or "path" in ref):  # the HF datasets image shape
        return image_bytes(ref["bytes"] if ref.get("bytes") is not None else ref["path"], base_dir)
    elif isinstance(ref, str):
        data = _from_string(ref, base_dir)
    elif hasattr(ref, "save") and hasattr(ref, "mode"):  # a PIL image
        out = io.BytesIO()
        ref.save(out, format="PNG")
        data = out.getvalue()
    else:
        raise ValueError(f"an image must be a path, a data URI, base64, bytes or a PIL image, not {type(ref).__name__}")
    if image_format(data) is None:
        raise ValueError(f"not an image file (no PNG/JPEG/GIF/WebP/BMP signature): {_short(ref)}")
    return data


def _from_string(ref: str, base_dir: Path | None) -> bytes:
    if ref.startswith("data:"):
        head, _, payload = ref.partition(",")
        if ";base64" not in head or not head[5:].startswith("image/"):
            raise ValueError(f"a data URI image must be data:image/...;base64,...: {_short(ref)}")
        data = _from_base64(payload)
        if data is None:
            raise ValueError(f"the data URI does not hold base64 image bytes: {_short(ref)}")
        return data
    if ref.startswith(("http://", "https://")):
        raise ValueError(f"images are never downloaded: store {_short(ref)} next to the data file and give its path")
    path = Path(ref.removeprefix("file://")).expanduser()
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    if path.is_file():
        return path.read_bytes()
    data = _from_base64(ref) if len(ref) > 64 else None
    if data is None:
        raise ValueError(f"image {_short(ref)} is neither a file (looked at {path}) nor base64 image bytes")
    return data


def data_uri(data: bytes) -> str:
    """`data:image/<format>;base64,...` of encoded image bytes (what OpenAI-style `image_url` parts carry)."""
    return f"data:image/{image_format(data) or 'png'};base64,{base64.b64encode(data).decode('ascii')}"


def _short(ref: Any) -> str:
    text = ref if isinstance(ref, str) else repr(ref)
    return repr(text if len(text) <= 80 else text[:77] + "...")
