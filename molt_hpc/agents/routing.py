"""A trajectory's MoE routing, assembled turn by turn from the engine's `routed_experts` (router replay).

An engine forwards a turn's whole context (`P` tokens) and its generated tokens but the last, so it
knows the routing of positions `[0, P + G - 1)`. Positions an earlier turn already covered are not
asked for again (`sampling_params.routed_experts_prompt_start`): the first turn to see a position
keeps its routing, and each turn adds rows `[have, P + G - 1)`. The last token of the trajectory
stays -1 (nothing forwarded it). A reply with the wrong row count or shape (a preempted or aborted
request, speculative decoding, an engine without capture) drops the sample's routing altogether:
it is trained without replay (the trainer counts it), never with misaligned rows.
"""

import numpy as np

from molt_hpc.trajectory import ROUTING_DTYPE


class RoutingTrace:
    """The routing rows of one trajectory so far."""

    def __init__(self) -> None:
        self.have = 0
        """Positions `[0, have)` have routing: the next turn's `routed_experts_prompt_start`."""
        self.parts: list[np.ndarray] = []
        self.lost = False

    def add(self, routed: np.ndarray | None, context_len: int, generated: int) -> None:
        """Take one turn's reply: `context_len` tokens in, `generated` out."""
        if self.lost or generated == 0:
            return
        end = context_len + generated - 1
        shape = self.parts[0].shape[1:] if self.parts else None
        if routed is None or len(routed) != end - self.have or (shape is not None and routed.shape[1:] != shape):
            self.lost = True
            return
        self.parts.append(routed.astype(ROUTING_DTYPE))
        self.have = end

    def rows(self, n_tokens: int) -> np.ndarray | None:
        """`[n_tokens, layers, top_k]` int16, -1 where unknown; None when the routing was lost or never came."""
        if self.lost or not self.parts:
            return None
        out = np.full((n_tokens, *self.parts[0].shape[1:]), -1, dtype=ROUTING_DTYPE)
        known = np.concatenate(self.parts)[:n_tokens]
        out[: len(known)] = known
        return out
