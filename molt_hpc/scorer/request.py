"""The classify request both scorers take, typed (no torch: the vLLM scorer's front uses it too)."""

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field


class ClassifyRequest(BaseModel):
    """Body of `POST /classify` (vLLM's names): token-id sequences only, this scorer takes no text."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True, allow_inf_nan=False)

    input: list[list[int]] | list[int] = Field(min_length=1)
    """Sequences of token ids, or one sequence (as vLLM accepts it)."""
    use_activation: bool | None = None
    """Apply the sigmoid to the scores."""
    model: str | None = None

    @property
    def sequences(self) -> list[list[int]]:
        seqs = self.input
        if all(isinstance(t, int) for t in seqs):
            return [seqs]  # type: ignore[list-item]
        for i, s in enumerate(seqs):
            if not s:
                raise ValueError(f"input[{i}] must be a non-empty list of token ids")
        return seqs  # type: ignore[return-value]


MAX_TOP_K = 20
"""Most top tokens a logprobs request may ask for per position (vLLM's default `--max-logprobs`)."""


class LogprobsRequest(BaseModel):
    """Body of a teacher's `POST /logprobs`: token-id sequences and, per sequence, the half-open spans of
    tokens to score (a rollout's action ranges); the answer is log p(token t | tokens before t) of each."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True, allow_inf_nan=False)

    input: list[list[int]] = Field(min_length=1)
    """Sequences of token ids."""
    ranges: list[list[Annotated[list[int], Field(min_length=2, max_length=2)]]]
    """Per sequence, the [start, end) spans whose tokens are scored, each within 1..len (token 0 has no context)."""
    temperature: float = Field(1.0, gt=0.0)
    """Log-probs of `softmax(logits / temperature)`, as the engines report the sampled tokens'."""
    top_k: int = Field(0, ge=0, le=MAX_TOP_K)
    """Also answer, per scored token, the teacher's `top_k` most likely tokens at that position and their
    log-probs (`top_ids`, `top_logprobs`, most likely first); 0: the scored tokens' log-probs only."""

    def spans(self) -> list[list[tuple[int, int]]]:
        """The spans, checked against their sequences (a `ValueError` says which is wrong)."""
        if len(self.ranges) != len(self.input):
            raise ValueError(f"{len(self.ranges)} range lists for {len(self.input)} sequences; give one per sequence")
        for i, (seq, spans) in enumerate(zip(self.input, self.ranges, strict=True)):
            if not seq:
                raise ValueError(f"input[{i}] must be a non-empty list of token ids")
            for start, end in spans:
                if not 1 <= start < end <= len(seq):
                    raise ValueError(f"ranges[{i}] has the span {[start, end]} outside 1..{len(seq)} (or empty)")
        return [[(a, b) for a, b in spans] for spans in self.ranges]
