"""Qwen2-VL's multimodal rotary positions (mRoPE), a pure function of the token layout.

Every token has three position ids (time, height, width). Text tokens count up by one on all three.
An image's `t·h·w / merge²` placeholder tokens form its merged grid: starting at the next free
position p, token (i, j, k) of the grid gets (p + i, p + j, p + k); the text after the image starts
at one past the largest position the image used. So a sequence with images ends at a position below
its length: `delta = max position + 1 - length` (zero or negative) shifts every later token, which is
how an engine positions its decode steps. The same rule is transformers' `get_rope_index` and vLLM's
`get_mrope_input_positions`; computing it here keeps the trainer and the builtin engine independent
of either's signature (it changed between transformers releases).
"""

from collections.abc import Sequence

import torch
from torch import Tensor


def rope_positions(n_tokens: int, images: Sequence, merge: int) -> tuple[Tensor, int]:
    """(`[3, n_tokens]` int64 position ids, delta) of a sequence whose images (objects with `offset`,
    `length` and `grid`, in order; `TraceImage`s) lie inside it."""
    parts: list[Tensor] = []
    at = nxt = 0  # token index reached, next free position
    for im in images:
        t, h, w = im.grid[0], im.grid[1] // merge, im.grid[2] // merge
        assert t * h * w == im.length and im.offset >= at, f"image at {im.offset}: grid {im.grid} vs {im.length} tokens"
        text = im.offset - at
        parts.append((torch.arange(text) + nxt).expand(3, text))
        nxt += text
        grid = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij"))
        parts.append(grid.reshape(3, -1) + nxt)
        nxt += max(t, h, w)
        at = im.end
    assert at <= n_tokens, "an image ends past the sequence"
    parts.append((torch.arange(n_tokens - at) + nxt).expand(3, n_tokens - at))
    positions = torch.cat(parts, dim=1)
    return positions, nxt + (n_tokens - at) - n_tokens
