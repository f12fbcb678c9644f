"""The running batch's KV cache: one transformers `DynamicCache` plus a [B, L] attention mask.

Rows are right-aligned: every row's real tokens end at the last column, and shorter rows are
left-padded (mask 0, K/V zero). That is the layout transformers' own batched generation uses, so a
decode step is one forward over [B, 1] with per-row position ids. Rows join by left-padding the
shorter of the two caches to the longer length and concatenating along the batch; rows leave by
index selection, after which columns that are padding in every remaining row are cut off, so the
cache is never longer than its longest row.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def _layers(cache) -> list:
    layers = cache.layers
    assert all(hasattr(layer, "keys") and hasattr(layer, "values") for layer in layers), "dynamic layers only"
    return layers


@dataclass
class BatchCache:
    """KV cache and attention mask of the running rows, in row order."""

    cache: object
    mask: torch.Tensor

    @property
    def rows(self) -> int:
        return self.mask.shape[0]

    @property
    def length(self) -> int:
        return self.mask.shape[1]

    def left_pad(self, n: int) -> None:
        """Add `n` padding columns on the left of every row."""
        if n <= 0:
            return
        for layer in _layers(self.cache):
            layer.keys = F.pad(layer.keys, (0, 0, n, 0))
            layer.values = F.pad(layer.values, (0, 0, n, 0))
        self.mask = F.pad(self.mask, (n, 0))

    def merge(self, other: "BatchCache") -> None:
        """Append `other`'s rows after this cache's rows (same model, same layers)."""
        length = max(self.length, other.length)
        self.left_pad(length - self.length)
        other.left_pad(length - other.length)
        for mine, theirs in zip(_layers(self.cache), _layers(other.cache), strict=True):
            mine.keys = torch.cat([mine.keys, theirs.keys], dim=0)
            mine.values = torch.cat([mine.values, theirs.values], dim=0)
        self.mask = torch.cat([self.mask, other.mask], dim=0)

    def keep(self, rows: list[int], width: int | None = None) -> None:
        """Keep only `rows` (in that order), then cut the columns that are padding in all of them (which
        also covers `width`, the slot cache's bound on the columns in use)."""
        assert rows, "an empty batch has no cache; drop the BatchCache instead"
        idx = torch.tensor(rows, device=self.mask.device)
        mask = self.mask.index_select(0, idx)
        real = mask.any(dim=0).nonzero()
        start = int(real[0]) if len(real) else mask.shape[1]
        self.mask = mask[:, start:]
        for layer in _layers(self.cache):
            layer.keys = layer.keys.index_select(0, idx)[:, :, start:]
            layer.values = layer.values.index_select(0, idx)[:, :, start:]

    def extend_mask(self) -> torch.Tensor:
        """The mask for a decode step (one more real column per row); becomes the cache's mask."""
        self.mask = F.pad(self.mask, (0, 1), value=1)
        return self.mask
