"""A chat-mode episode's trace, rebuilt from the calls the chat endpoint served: token in, trace out.

Every completion the endpoint serves is recorded as a `ChatCall`: the exact prompt ids it sent, the
ids the engine produced with their per-token log-probs and weight versions, and the MoE routing when
router replay asks for it. A call whose prompt extends an earlier call's prompt + completion token for
token continues that call's *segment*: its completion is one more action of the same sequence, the
text in between (the next user or tool turn) context. A call whose prompt extends none (the chat
template re-rendered the history with other tokens than the engine produced, or the agent started
another conversation) opens a new segment. The trajectory is the segments one after the other
(`Trajectory.segments` marks where each starts): each trains as its own sequence with the engine's
own log-probs, so chat mode gets the same off-policy correction as env mode, and nothing the engine
produced is dropped, except where the segments together pass `rollout.max_total_tokens` (a trainer
row): then the earliest segments are left out and counted.
"""

from dataclasses import dataclass, field

import numpy as np

from molt_hpc.agents.routing import RoutingTrace
from molt_hpc.trajectory import ROUTING_DTYPE, Trajectory


@dataclass
class ChatCall:
    """One completion served to a session."""

    prompt_ids: list[int]
    """The token ids sent to the engine (the rendered conversation, and a forced tool-call opening)."""
    completion_ids: list[int]
    """What the engine produced (its stop token included)."""
    logprobs: list[float]
    """The engine's processed log-prob of every completion token."""
    versions: list[int]
    """The weight version that produced every completion token."""
    finish_reason: str
    """The engine's finish reason (`stop`, `length`)."""
    routed_experts: np.ndarray | None = None
    """MoE router replay: the engine's routing of positions `[routed_from, prompt + completion - 1)`."""
    routed_from: int = 0
    """The first position `routed_experts` covers (the routing an earlier call of the segment gave is not
    asked for again)."""


@dataclass
class Segment:
    """One sequence of the trace: a first prompt and every call that extended it."""

    tokens: list[int]
    prompt_len: int
    ranges: list[tuple[int, int]] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    routing: RoutingTrace | None = None

    def add(self, call: ChatCall) -> None:
        """Take `call`, whose prompt extends this segment's tokens."""
        start = len(call.prompt_ids)
        self.tokens = list(call.prompt_ids) + list(call.completion_ids)
        if call.completion_ids:
            self.ranges.append((start, len(self.tokens)))
        self.logprobs += [float(x) for x in call.logprobs]
        self.versions += [int(v) for v in call.versions]
        if self.routing is not None:
            self.routing.add(call.routed_experts, start, len(call.completion_ids))


def extends(prompt_ids: list[int], tokens: list[int]) -> bool:
    """Whether `prompt_ids` starts with every token of `tokens`."""
    return len(prompt_ids) >= len(tokens) and prompt_ids[: len(tokens)] == tokens


def find_segment(segments: list[Segment], prompt_ids: list[int]) -> Segment | None:
    """The latest segment that `prompt_ids` continues, or None."""
    return next((s for s in reversed(segments) if extends(prompt_ids, s.tokens)), None)


def segments_of(calls: list[ChatCall], routed: bool = False) -> list[Segment]:
    """The calls grouped into segments, in the order each segment's first call came."""
    segments: list[Segment] = []
    for call in calls:
        seg = find_segment(segments, call.prompt_ids)
        if seg is None:
            seg = Segment([], len(call.prompt_ids), routing=RoutingTrace() if routed else None)
            segments.append(seg)
        seg.add(call)
    return segments


def routing_start(calls: list[ChatCall], prompt_ids: list[int]) -> int:
    """`routed_experts_prompt_start` of the next call of a session: the positions the segment it continues
    already has routing for (0 for a new segment, or one whose routing was lost)."""
    seg = find_segment(segments_of(calls, routed=True), prompt_ids)
    if seg is None or seg.routing is None or seg.routing.lost:
        return 0
    return seg.routing.have


def trajectory_from_calls(
    calls: list[ChatCall], *, max_tokens: int, rollout_id: str = "", group_id: str = ""
) -> tuple[Trajectory, int, int]:
    """The trajectory of a session's calls: (trajectory, segments after the first, segments left out to fit
    `max_tokens`). Segments without an action are left out unnoticed: they have nothing to train."""
    routed = any(c.routed_experts is not None for c in calls)
    segments = [s for s in segments_of(calls, routed) if s.ranges]
    kept: list[Segment] = []
    total = 0
    for seg in reversed(segments):  # the latest segments are kept: the last holds the whole conversation
        if kept and total + len(seg.tokens) > max_tokens:
            break
        kept.insert(0, seg)
        total += len(seg.tokens)
    if not kept:  # every call produced nothing: the trace is the last prompt, without an action
        last = calls[-1]
        kept = [Segment(list(last.prompt_ids), len(last.prompt_ids))]
    tokens, ranges, logprobs, versions, starts = [], [], [], [], []
    for seg in kept:
        if tokens:
            starts.append(len(tokens))
        ranges += [(a + len(tokens), b + len(tokens)) for a, b in seg.ranges]
        tokens += seg.tokens
        logprobs += seg.logprobs
        versions += seg.versions
    traj = Trajectory(
        tokens=tokens,
        prompt_len=kept[0].prompt_len,
        action_ranges=ranges,
        action_logprobs=logprobs,
        versions=versions,
        finish_reason=calls[-1].finish_reason,
        group_id=group_id,
        rollout_id=rollout_id,
        routed_experts=_routing(kept) if routed else None,
        segments=starts,
    )
    return traj, max(0, len(segments) - 1), len(segments) - len(kept) if segments else 0


def _routing(segments: list[Segment]) -> np.ndarray | None:
    """The segments' routing rows one after the other, or None when any segment's routing was lost."""
    rows = [s.routing.rows(len(s.tokens)) if s.routing is not None else None for s in segments]
    if any(r is None for r in rows):
        return None
    return np.concatenate(rows).astype(ROUTING_DTYPE, copy=False)
