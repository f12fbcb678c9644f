"""Chat messages with images: normalising their image parts and tokenising them once.

An image part is `{"type": "image"}` (takes the next of the row's images), `{"type": "image", "image":
ref}`, or `{"type": "image_url", "image_url": {"url": ref}}` (the image travels inline). In text
content, each `<image>` mark becomes an image part where it stands; text content with no mark but
with images given (a plain prompt, an env's observation) gets them in front of the last user turn's text
(or of the last text, for a tool's observation). After
normalising, every image part is `{"type": "image"}`, which the chat template turns into the model's
placeholder (`<|vision_start|><|image_pad|><|vision_end|>` for Qwen2-VL); `Vision.expand` then repeats
each pad to its image's token count. That happens once: the ids are the trace from then on.
"""

from typing import Any

IMAGE_MARK = "<image>"
IMAGE_PARTS = ("image", "image_url")


def _split_marks(text: str) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = []
    for i, piece in enumerate(text.split(IMAGE_MARK)):
        if i:
            parts.append({"type": "image"})
        if piece:
            parts.append({"type": "text", "text": piece})
    return parts


def _inline_ref(part: dict[str, Any]) -> Any:
    """The image a part carries itself, or None when it takes the next of the row's images."""
    if part["type"] == "image_url":
        url = part.get("image_url")
        url = url.get("url") if isinstance(url, dict) else url
        if not isinstance(url, str):
            raise ValueError("an image_url part needs {'image_url': {'url': ...}}")
        return url
    return part.get("image")


def normalise(messages: list[dict[str, Any]], images: list[Any]) -> tuple[list[dict[str, Any]], list[Any]]:
    """(messages whose image parts are all `{"type": "image"}`, the image references in part order).

    `images` are the row's (or the env's) images; each bare image part takes the next one. Every
    image must be used and every part must find one: a `ValueError` otherwise."""
    row_images = list(images)
    front = -1  # images given for plain text: they go before the last user turn's text (else the last text)
    if row_images and not has_images(messages):
        texts = [i for i, m in enumerate(messages) if isinstance(m.get("content"), str)]
        users = [i for i in texts if messages[i].get("role") == "user"]
        front = (users or texts or [-1])[-1]
    out, refs, taken = [], [], 0
    for i, msg in enumerate(messages):
        content = msg.get("content")
        if isinstance(content, str):
            if IMAGE_MARK in content:
                content = _split_marks(content)
            elif i == front:
                content = [{"type": "image"}] * len(row_images) + ([{"type": "text", "text": content}] * bool(content))
        if isinstance(content, list):
            parts = []
            for part in content:
                if part.get("type") not in IMAGE_PARTS:
                    parts.append(part)
                    continue
                ref = _inline_ref(part)
                if ref is None:
                    if taken >= len(row_images):
                        raise ValueError(f"more image parts than the {len(row_images)} image(s) given")
                    ref, taken = row_images[taken], taken + 1
                refs.append(ref)
                parts.append({"type": "image"})
            content = parts
        out.append({**msg, "content": content})
    if taken < len(row_images):
        raise ValueError(f"{len(row_images)} image(s) given but only {taken} image part(s) use them")
    return out, refs


def _count_marks(msg: dict[str, Any]) -> int:
    content = msg.get("content")
    if isinstance(content, str):
        return content.count(IMAGE_MARK)
    if isinstance(content, list):
        return sum(1 for p in content if isinstance(p, dict) and p.get("type") in IMAGE_PARTS)
    return 0


def has_images(messages: list[dict[str, Any]]) -> bool:
    """Whether any message has an image part (or an `<image>` mark)."""
    return any(_count_marks(m) for m in messages)
