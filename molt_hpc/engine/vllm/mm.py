"""Images through vLLM 0.26's HTTP API: our `mm` field → render → `/inference/v1/generate` with `features`.

vLLM's token route takes no images. It takes `features` (`MultiModalFeatures` in
`vllm/entrypoints/scale_out/token_in_token_out/protocol.py`): per modality the item hashes, the
placeholder ranges `{offset, length}` in `token_ids`, and `kwargs_data`, each item's processed
tensors as base64 msgpack of vLLM's own encoder (`mm_serde.py`), an internal format made by vLLM,
never by us. With features, vLLM uses `token_ids` as given (its processor does not run), so they
must hold the expanded placeholders: ours do (token in, trace out).

So per request with images the front:
1. `POST /v1/chat/completions/render` with one user message of `image_url` parts (data URIs): vLLM's
   processor runs on them (its cache skipped) and answers a `GenerateRequest` whose `features` hold
   the items' tensors and hashes, placed in *its* rendering of that message;
2. keeps the items, replaces the placeholders with our spans (the same images in our token ids), and
   checks that every span is as long as vLLM's item: a different count means the engine's image
   processor config differs from the one that expanded the trace (a 400 saying so, never a silently
   misaligned image);
3. salts each hash with the weight version: vLLM caches encoder outputs and prefix blocks under these
   hashes, and after a refit the old features are stale;
4. posts `/inference/v1/generate` with our `token_ids`, sampling params and these `features`.

vLLM runs with `--mm-processor-cache-gb 0` (a processor cache that outlives a refit fails with
"Expected a cached item") and without `--skip-tokenizer-init` (render applies the chat template).
"""

from typing import Any

MODALITY = "image"


def render_request(mm: dict[str, Any]) -> dict[str, Any]:
    """The render call for the images of `mm` (`{"images": [data URIs], "spans": [[offset, length]]}`)."""
    if not isinstance(mm, dict) or not isinstance(mm.get("images"), list) or not isinstance(mm.get("spans"), list):
        raise ValueError("mm must be {'images': [data URIs], 'spans': [[offset, length], ...]}")
    if len(mm["images"]) != len(mm["spans"]) or not mm["images"]:
        raise ValueError("mm.images and mm.spans must be lists of the same (non-zero) length")
    for ref in mm["images"]:
        if not isinstance(ref, str) or not ref.startswith("data:image/"):
            raise ValueError("mm.images must be data:image/...;base64 URIs for a vLLM engine")
    parts = [{"type": "image_url", "image_url": {"url": ref}} for ref in mm["images"]]
    return {"messages": [{"role": "user", "content": parts}], "max_completion_tokens": 1}


def features(rendered: dict[str, Any], mm: dict[str, Any], token_ids: list[int], version: int) -> dict[str, Any]:
    """vLLM `features` for our `token_ids`: the rendered items at our spans, hashes salted with `version`."""
    got = rendered.get("features") or {}
    hashes = (got.get("mm_hashes") or {}).get(MODALITY) or []
    places = (got.get("mm_placeholders") or {}).get(MODALITY) or []
    items = (got.get("kwargs_data") or {}).get(MODALITY) or []
    spans = mm["spans"]
    if not (len(hashes) == len(places) == len(items) == len(spans)):
        raise ValueError(
            f"vLLM rendered {len(places)} image item(s) ({len(items)} with tensors) for {len(spans)} image(s)"
        )
    if any(item is None for item in items):
        raise ValueError("vLLM answered an image item without its tensors: run it with --mm-processor-cache-gb 0")
    end = 0
    for i, (span, place) in enumerate(zip(spans, places, strict=True)):
        ok = isinstance(span, list) and len(span) == 2 and all(isinstance(x, int) for x in span)
        if not ok or span[0] < end or span[0] + span[1] > len(token_ids):
            raise ValueError(f"mm.spans[{i}] = {span} is not a run inside the {len(token_ids)} token ids after {end}")
        if int(place["length"]) != span[1]:
            raise ValueError(
                f"image {i}: vLLM's image processor makes {place['length']} tokens of it, the trace holds {span[1]}: "
                "the engine's preprocessor config (or --mm-processor-kwargs) differs from the one that tokenised "
                "the trace; serve the model directory the run resolved, unchanged"
            )
        end = span[0] + span[1]
    return {
        "mm_hashes": {MODALITY: [f"{h}-v{version}" for h in hashes]},
        "mm_placeholders": {MODALITY: [{"offset": o, "length": n} for o, n in spans]},
        "kwargs_data": {MODALITY: list(items)},
    }
