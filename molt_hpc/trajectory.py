"""The data that flows from rollout to training: one `Trajectory` per sample, one `Group` per prompt.

Token in, trace out: `tokens` is exactly what the engine saw plus what it produced, never
re-tokenised. `action_ranges` are the spans the model produced; everything else (prompt, env
feedback) is context that never trains. MoE routing travels like the tokens, one row per token.
Images (vision-language models) travel with the tokens: each `TraceImage` holds the encoded image and
the run of placeholder tokens its features fill. A chat-mode trace whose chat template re-rendered the
history differently from what the engine saw is cut into *segments* (`segments`): each is its own
token sequence (the exact prompt one call sent and what followed it), trained with its own log-probs
as its own forward pass (position ids restart at every segment), while the sample stays one sample:
one reward, one advantage, one member of its group. The replay buffer stores and hands over whole
`Group`s, because GRPO-style advantages compare the samples of one prompt.
"""

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import numpy as np

ROUTING_DTYPE = np.int16
"""Expert ids of `Trajectory.routed_experts`: -1 (unknown) must survive, and 32767 experts is plenty."""


@dataclass(frozen=True)
class TraceImage:
    """One image of a trajectory: its encoded bytes and the placeholder tokens its features fill."""

    data: bytes
    """The image file's bytes (PNG, JPEG, ...), exactly as loaded; engines and trainer decode the same bytes."""
    offset: int
    """Index in `Trajectory.tokens` of its first placeholder (image pad) token."""
    length: int
    """Placeholder tokens: the image's patch grid t·h·w over the merge size squared."""
    grid: tuple[int, int, int]
    """(t, h, w) patch grid the image processor made of it (Qwen2-VL's `image_grid_thw`)."""

    @property
    def end(self) -> int:
        return self.offset + self.length

    def moved(self, by: int) -> "TraceImage":
        """The same image placed `by` tokens later."""
        return TraceImage(self.data, self.offset + by, self.length, self.grid)


@dataclass
class Trajectory:
    """One sample: a prompt and every turn that followed it."""

    tokens: list[int]
    """Prompt + all turns, as token ids."""
    prompt_len: int
    """Length of the first prompt (the prefix before the first action)."""
    action_ranges: list[tuple[int, int]]
    """Half-open [start, end) spans of `tokens` that the model produced, in order, non-overlapping."""
    action_logprobs: list[float]
    """Engine log-prob of every action token, in order (len == total action tokens)."""
    versions: list[int]
    """Policy version that produced every action token (len == total action tokens)."""
    reward: float = 0.0
    """Scalar reward of the whole trajectory."""
    score: float | None = None
    """What is reported as the task score (defaults to the reward)."""
    finish_reason: str = "stop"
    """Why the last turn ended: `stop` (EOS/stop token), `length` (a length cap), `abort`."""
    info: dict[str, Any] = field(default_factory=dict)
    """Environment metrics (JSON-able scalars)."""
    group_id: str = ""
    """Id shared by all samples of one prompt."""
    rollout_id: str = ""
    """Unique id of this sample (also its router session id)."""
    routed_experts: np.ndarray | None = None
    """MoE router replay only: the experts the engine routed each token to, `[tokens, layers, top_k]`
    int16 (global expert ids, the layer axis every decoder layer, dense ones included), aligned 1:1
    with `tokens`; -1 where the engine never forwarded the token (the last one) or did not say.
    A list of lists is converted."""
    images: list[TraceImage] = field(default_factory=list)
    """Vision-language models: every image of the trace (the prompt's and the observations'), in order
    of their placeholder runs, which never overlap an action."""
    segments: list[int] = field(default_factory=list)
    """Offsets in `tokens` where a new independent sequence starts (chat mode, after a prefix break),
    ascending; empty for one sequence. No action starts at or spans a segment start: every segment
    opens with a prompt of its own, and attention never crosses into an earlier segment."""
    teacher_logprobs: list[float] | None = None
    """On-policy distillation (`[distill]`): the teacher's log-prob of every action token, in order (len ==
    total action tokens), at the rollout's temperature; None until a teacher scored the sample."""
    teacher_top_ids: list[list[int]] | None = None
    """`distill.top_k`: per action token, in order, the teacher's `top_k` most likely tokens at its position,
    most likely first; None without."""
    teacher_top_logprobs: list[list[float]] | None = None
    """The teacher's log-probs of `teacher_top_ids`, laid out alike."""

    def __post_init__(self) -> None:
        if self.routed_experts is not None:
            self.routed_experts = np.asarray(self.routed_experts, dtype=ROUTING_DTYPE)
            r = self.routed_experts
            assert r.ndim == 3 and r.shape[0] == len(self.tokens), "one routing row [layers, top_k] per token"
        n_action = sum(end - start for start, end in self.action_ranges)
        assert len(self.action_logprobs) == n_action, "one log-prob per action token"
        assert len(self.versions) == n_action, "one policy version per action token"
        taught = self.teacher_logprobs
        assert taught is None or len(taught) == n_action, "one teacher log-prob per action token"
        ids, top = self.teacher_top_ids, self.teacher_top_logprobs
        assert (ids is None) == (top is None), "the teacher's top ids and log-probs come together"
        if ids is not None and top is not None:
            assert len(ids) == len(top) == n_action, "one row of teacher top tokens per action token"
            assert len({len(r) for r in (*ids, *top)}) <= 1, "the same number of teacher top tokens everywhere"
        last = self.prompt_len
        for start, end in self.action_ranges:
            assert last <= start < end <= len(self.tokens), f"bad action range {(start, end)}"
            last = end
        if self.images:
            _check_images(self.images, self.action_ranges, len(self.tokens))
        if self.segments:
            _check_segments(self.segments, self.action_ranges, len(self.tokens), self.prompt_len)
            assert not self.images, "a segmented trace carries no images"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Trajectory):
            return NotImplemented
        for f in dataclasses.fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if f.name == "routed_experts":  # an array: compare values, not element-wise truth
                same = (a is None) == (b is None) and (a is None or np.array_equal(a, b))
            else:
                same = a == b
            if not same:
                return False
        return True

    __hash__ = None  # mutable, like every dataclass with an __eq__

    @property
    def num_action_tokens(self) -> int:
        return len(self.action_logprobs)

    @property
    def response_len(self) -> int:
        """Tokens after the first prompt; for a segmented trace, of its last segment (the conversation as
        it was last rendered), which holds every turn."""
        return len(self.tokens) - (self.segments[-1] if self.segments else 0) - self.prompt_len


def _check_images(images: list[TraceImage], ranges: list[tuple[int, int]], n_tokens: int) -> None:
    last = 0
    for im in images:
        assert last <= im.offset and im.length > 0 and im.end <= n_tokens, f"bad image span {(im.offset, im.length)}"
        last = im.end
    for start, end in ranges:
        assert not any(im.offset < end and start < im.end for im in images), "an action overlaps an image's tokens"


def _check_segments(segments: list[int], ranges: list[tuple[int, int]], n_tokens: int, prompt_len: int) -> None:
    last = prompt_len
    for s in segments:
        assert last < s < n_tokens, f"segment starts must ascend past the first prompt inside the trace: {segments}"
        last = s
    for start, end in ranges:
        assert not any(start <= s < end for s in segments), f"an action {(start, end)} opens or spans a segment"


@dataclass
class Group:
    """All samples of one prompt: the unit of the replay buffer and of group advantages."""

    group_id: str
    """Unique id of the group."""
    prompt_id: str
    """Id of the dataset row (stable across epochs)."""
    samples: list[Trajectory]
    """The samples, each with this group's `group_id`."""
    data_position: dict[str, int] = field(default_factory=dict)
    """Where the prompt came from in the dataset cursor: {"epoch", "index"}."""
    meta: dict[str, Any] = field(default_factory=dict)
    """Free-form JSON-able metadata (label, filter decisions, timings)."""

    @property
    def min_version(self) -> int:
        """Oldest policy version that produced any token of the group (what staleness is judged on)."""
        return min((min(s.versions) for s in self.samples if s.versions), default=0)

    @property
    def max_version(self) -> int:
        return max((max(s.versions) for s in self.samples if s.versions), default=0)

    @property
    def rewards(self) -> list[float]:
        return [s.reward for s in self.samples]


FINISHED_REWARDS = "finished_rewards"
"""`Group.meta` key: `[sum, count]` of the env rewards of every finished sample this group reports: its
own, and those of the groups dynamic sampling dropped since the previous group reached the buffer."""


def finished_reward(groups: list[Group]) -> float | None:
    """The mean env reward over every finished sample that `groups` report (kept or filtered): the
    `reward` of a training step. A group without the record (written before it existed) reports its own
    samples."""
    total, count = 0.0, 0
    for g in groups:
        record = g.meta.get(FINISHED_REWARDS)
        if record is None:
            record = [sum(s.reward for s in g.samples), len(g.samples)]
        total, count = total + float(record[0]), count + int(record[1])
    return total / count if count else None
