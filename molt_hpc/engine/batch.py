"""The model side of the engine: rows, the prefill and decode forwards, and sampling a batch.

A `Row` is one request in the running batch. Its cache holds every token of its context but the
last one, which is the next decode step's input (the "pending" token). Prefill takes whole
contexts (a new prompt, or a running row whose cache was dropped after a weight update), fills a
fresh cache and returns the next-token logits, so joining and re-prefilling are one code path.
"""

import inspect
import random
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from molt_hpc.engine.kvcache import BatchCache
from molt_hpc.engine.sampling import SamplingParams, processed_logprobs, sample, seeded_bits


@dataclass(eq=False)
class Row:
    """One request: its prompt, what it generated so far, and where its answer goes."""

    prompt: list[int]
    params: SamplingParams
    future: Future
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    """Most likely (token, log-prob) pairs per step, when the request asked for `logprobs` > 0 or -1."""
    images: Any = None
    """The prompt's images (an `engine.vision.RowImages`), vision-language models only."""
    rope_delta: int = 0
    """Added to a decode step's position: multimodal positions run behind the token count after an image."""
    routing: Any = None
    """The experts of every forwarded position (an `engine.routing.RowRouting`) when routing is captured."""
    notify: Any = None
    """Called on the server's event loop after each step that gave the row a token (a streamed answer)."""

    def bits(self, rng: random.Random) -> int:
        """32 random bits for the row's next token: from its seed and the token's index when the request is
        seeded (the same tokens in any batch, on any device), else from the engine's stream `rng`."""
        seed = self.params.seed
        return rng.getrandbits(32) if seed is None else seeded_bits(seed, len(self.tokens))

    @property
    def context(self) -> list[int]:
        return self.prompt + self.tokens

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.tokens)


class ModelRunner:
    """Runs the transformers model over a `BatchCache` (no gradients, logits of the last position only)."""

    def __init__(self, model, device: torch.device):
        from transformers import DynamicCache

        kinds = set(getattr(model.config.get_text_config(), "layer_types", None) or ["full_attention"])
        if kinds != {"full_attention"}:
            raise ValueError(
                f"the builtin engine runs full-attention models only; this one has {sorted(kinds)} layers: "
                "use engines.kind = 'vllm'"
            )
        self.model = model
        self.device = device
        self._new_cache = DynamicCache
        params = inspect.signature(model.forward).parameters
        # transformers ≥ 5.x renamed `past_key_values` to `cache`; take whichever this version has.
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    @torch.inference_mode()
    def prefill(self, contexts: list[list[int]], images: list | None = None) -> tuple[torch.Tensor, BatchCache]:
        """Next-token logits [k, V] of each context and a cache holding all their tokens (left-padded);
        `images` (per context) only on a vision-language model's runner (`engine.vision.VisionRunner`)."""
        assert not any(images or []), "images reached a text model's runner"
        length = max(len(c) for c in contexts)
        ids = torch.zeros(len(contexts), length, dtype=torch.long)
        mask = torch.zeros(len(contexts), length, dtype=torch.long)
        for i, ctx in enumerate(contexts):
            ids[i, length - len(ctx) :] = torch.tensor(ctx)
            mask[i, length - len(ctx) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = self._new_cache()
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_kw: cache},
        )
        return out.logits[:, -1], BatchCache(cache, mask)

    def join(self, batch: BatchCache | None, part: BatchCache) -> BatchCache:
        """The running batch with the freshly prefilled rows `part` after its rows (`part` when none runs)."""
        if batch is None:
            return part
        batch.merge(part)
        return batch

    def release(self) -> None:
        """The scheduler dropped its running batch (all rows done, a refit, a failed step): a runner
        that prefills into its own storage starts over from its first row."""

    def decode_sampled(self, batch, rows: list[Row], last: list[int], positions: list[int], bits: list[int]):
        """(tokens, log-probs) of a decode step that also sampled, when this runner can (`SlotRunner`
        with sampling graphs), else None: the caller samples `decode`'s logits."""
        return None

    @torch.inference_mode()
    def decode(self, batch: BatchCache, last: list[int], positions: list[int]) -> torch.Tensor:
        """Feed each row's pending token; returns next-token logits [B, V]."""
        mask = batch.extend_mask()
        out = self.model(
            input_ids=torch.tensor(last, device=self.device)[:, None],
            attention_mask=mask,
            position_ids=torch.tensor(positions, device=self.device)[:, None],
            use_cache=True,
            **{self._cache_kw: batch.cache},
        )
        return out.logits[:, -1]


def plain_rows(rows: list[Row]) -> bool:
    """Whether every row samples plainly: temperature only (no top-k/top-p/min-p), no top log-probs (what
    `graphs.plain_sample` computes); seeded or not."""
    return all(p.top_k <= 0 and p.top_p >= 1.0 and p.min_p <= 0.0 and not p.logprobs for p in (r.params for r in rows))


def append_samples(rows: list[Row], tokens: list[int], logprobs: list[float]) -> None:
    for row, tok, lp in zip(rows, tokens, logprobs, strict=True):
        row.tokens.append(tok)
        row.logprobs.append(lp)


def sample_rows(rows: list[Row], logits: torch.Tensor, bits: list[int]) -> None:
    """Process each row's logits with its own parameters, draw one token each from its random `bits`
    (`Row.bits`) and append it to the row (with its log-prob and, where asked for, the top log-probs)."""
    params = [r.params for r in rows]
    # The parameters stay on the CPU: the filters' "is any row using it" checks then cost no device sync.
    logp = processed_logprobs(
        logits,
        torch.tensor([p.temperature for p in params]),
        torch.tensor([p.top_k for p in params]),
        torch.tensor([p.top_p for p in params]),
        torch.tensor([p.min_p for p in params]),
    )
    greedy = [p.temperature == 0 for p in params]
    drawn = sample(logp, greedy, bits)
    chosen = logp.gather(-1, drawn[:, None]).view(-1)
    tokens, lps = drawn.tolist(), chosen.tolist()  # the step's one read-back of tokens and log-probs
    append_samples(rows, tokens, lps)
    for i, row in enumerate(rows):
        want = row.params.logprobs
        if want:
            k = logp.shape[-1] if want < 0 else min(want, logp.shape[-1])
            values, ids = logp[i].topk(k)
            row.top.append(list(zip(ids.tolist(), values.tolist(), strict=True)))
