"""The classify request both scorers take, typed (no torch: the vLLM scorer's front uses it too)."""

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
