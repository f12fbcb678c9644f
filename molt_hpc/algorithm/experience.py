"""Step 4 of the RL loop: `list[Trajectory] -> Experience`, the tensors that training reads.

Conventions every module of `molt_hpc.algorithm` shares:

- **Own-index alignment.** A per-token value lives at the index of the token it is about:
  `action_log_probs[b, t]` is log p(sequences[b, t] | sequences[b, :t]), and so are `base_log_probs`,
  the trainer's log-probs from `logprobs.py`, `values` (the critic's estimate before token t is
  produced), `advantages` and `returns`. The logits at position t-1 predict token t, so whoever turns
  logits into per-token values shifts by one (`logprobs.py` does); index 0 of a sample is never an
  action (a trajectory needs a prompt of at least one token).
- **Samples vs rows.** `N` samples are laid out in `B` rows, one per row (right padding) or several
  per row (`pack=True`). `seq_index[b, t]` says which sample a token belongs to (`-1` on padding);
  per-sample tensors (`reward`, `group_index`, `truncated`) are `[N]`. Sequence-level math
  (GSPO, sequence IS weights, GAE) goes through `seq_index`, so it is right in both layouts.
- **Position ids restart at 0 for every sample** (and at every segment of a segmented chat-mode
  sample: each segment is its own sequence, `Trajectory.segments`), and the padding at the end of a
  row is one more block starting at 0. Give a transformers model `position_ids`, *no* `attention_mask` and
  `use_cache=False`: it then detects the restarts and builds a block-causal mask, so packed samples
  never see each other (with a cache, or with an attention mask, it does not look for packing).
- **Truncation to `max_len` never keeps half an action.** A trajectory longer than `max_len` is cut
  at `max_len`; when that cut falls inside an action span, the whole partial span is cut off too
  (its tokens leave the row). Earlier complete actions still train on the trajectory's reward.
  `truncated[n]` marks such samples and `stats` counts them and the action tokens dropped.
- **Images** (a vision-language batch, `vision=` a `VisionSpec`): `images[n]` are sample n's images
  in order, the ones whose tokens survived the cut; `rope_position_ids` are the multimodal positions
  the model takes instead of `position_ids`. A sample the cut would split through an image, or whose
  actions hold a vision token, is dropped (`molt_hpc.algorithm.vision`; counted in `stats`).
"""

import array
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from molt_hpc.algorithm.vision import drop_reason, kept_images, rope_rows
from molt_hpc.trajectory import Group, TraceImage, Trajectory
from molt_hpc.vision.spec import VisionSpec

TOKEN_FIELDS = (
    "sequences",
    "attention_mask",
    "position_ids",
    "seq_index",
    "action_mask",
    "action_log_probs",
    "old_log_probs",
    "versions",
    "base_log_probs",
    "values",
    "advantages",
    "returns",
    "routed_experts",
    "rope_position_ids",
    "teacher_log_probs",
    "teacher_top_ids",
    "teacher_top_log_probs",
)


@dataclass
class Experience:
    """A training batch. Token tensors are `[B, T]`; per-sample tensors are `[N]`."""

    sequences: Tensor
    """Token ids `[B, T]` int64 (padding is `pad_id`)."""
    attention_mask: Tensor
    """`[B, T]` bool: True on real tokens, False on padding."""
    position_ids: Tensor
    """`[B, T]` int64, restarting at 0 for every sample (and for the padding block)."""
    seq_index: Tensor
    """`[B, T]` int64: the sample (0..N-1) each token belongs to, -1 on padding."""
    action_mask: Tensor
    """`[B, T]` bool: True on model-produced tokens, the only ones that train."""
    action_log_probs: Tensor
    """`[B, T]` float32: the engine's log-prob of each action token at its own index, 0 elsewhere."""
    versions: Tensor
    """`[B, T]` int64: policy version that produced each action token, -1 elsewhere."""
    reward: Tensor
    """`[N]` float32: scalar reward per sample."""
    group_index: Tensor
    """`[N]` int64: the group (prompt) of each sample, numbered 0..G-1."""
    truncated: Tensor
    """`[N]` bool: the sample lost tokens to `max_len`."""
    base_log_probs: Tensor | None = None
    """`[B, T]`: reference-model log-probs (filled by the actor when the KL is used)."""
    old_log_probs: Tensor | None = None
    """`[B, T]`: the trainer's log-probs under the weights that start the step (the PPO old policy),
    filled by the actor when `AlgorithmConfig.recompute_old` says so; None: the engine's are the old."""
    values: Tensor | None = None
    """`[B, T]`: critic values (GAE only)."""
    advantages: Tensor | None = None
    """`[B, T]`: per-token advantages (filled by `advantage.compute_advantages`)."""
    returns: Tensor | None = None
    """`[B, T]`: per-token returns (critic targets for GAE)."""
    routed_experts: Tensor | None = None
    """`[B, T, layers, top_k]` int16 (MoE router replay): the engine's experts of each token, -1 where
    unknown (padding, a sample without routing, the last token of each sample)."""
    rope_position_ids: Tensor | None = None
    """`[B, T, 3]` int64 (vision-language models): multimodal (time, height, width) positions, restarting
    per sample like `position_ids`, which they equal on every axis outside images."""
    images: list[list[TraceImage]] | None = None
    """`[N]` (vision-language models): each sample's images, in the order of their tokens."""
    teacher_log_probs: Tensor | None = None
    """`[B, T]` float32 (`[distill]`): the teacher's log-prob of each action token at its own index, 0 elsewhere."""
    teacher_top_ids: Tensor | None = None
    """`[B, T, k]` int64 (`distill.top_k`): the teacher's k most likely tokens at each action token's position."""
    teacher_top_log_probs: Tensor | None = None
    """`[B, T, k]` float32: their log-probs (0 off the action tokens, like the ids)."""
    stats: dict[str, int] = field(default_factory=dict)
    """Assembly counts: samples, rows, truncated_samples, dropped_action_tokens, empty_samples, and
    unrouted_samples (samples without routing in a batch that has some); with images also vlm_truncation
    and media_token (samples dropped for each reason)."""

    @property
    def num_samples(self) -> int:
        return int(self.reward.shape[0])

    @property
    def num_action_tokens(self) -> int:
        return int(self.action_mask.sum().item())

    def rows(self, index: slice | Tensor) -> "Experience":
        """The batch restricted to some rows (a micro-batch); per-sample tensors are shared, whole."""
        picked = {name: (None if getattr(self, name) is None else getattr(self, name)[index]) for name in TOKEN_FIELDS}
        return dataclasses.replace(self, **picked)

    def split(self, rows_per_micro_batch: int) -> list["Experience"]:
        """Consecutive micro-batches of at most `rows_per_micro_batch` rows."""
        if rows_per_micro_batch < 1:
            raise ValueError(f"rows_per_micro_batch must be >= 1, got {rows_per_micro_batch}")
        b = self.sequences.shape[0]
        return [self.rows(slice(i, i + rows_per_micro_batch)) for i in range(0, b, rows_per_micro_batch)]

    def to(self, device: torch.device | str) -> "Experience":
        moved = {
            f.name: getattr(self, f.name).to(device)
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), Tensor)
        }
        return dataclasses.replace(self, **moved)


@dataclass
class _Kept:
    """One trajectory after truncation."""

    tokens: list[int]
    ranges: list[tuple[int, int]]
    logprobs: list[float]
    versions: list[int]
    routed: np.ndarray | None
    dropped: int
    teacher: list[float] | None = None
    top: tuple[list, list] | None = None  # the teacher's top (ids, log-probs) rows, per action token
    images: list[TraceImage] = field(default_factory=list)
    segments: list[int] = field(default_factory=list)
    why_dropped: str | None = None
    """Set when the whole sample is dropped (see `molt_hpc.algorithm.vision`)."""


def _truncate(traj: Trajectory, max_len: int, vision: VisionSpec | None = None, pad_id: int = 0) -> _Kept:
    cut = min(len(traj.tokens), max_len)
    for start, end in traj.action_ranges:
        if start < cut < end:  # the cut falls inside this action: drop the whole partial span
            cut = start
            break
    if vision is not None and (why := drop_reason(traj, cut, vision)) is not None:
        routed = None if traj.routed_experts is None else traj.routed_experts[:1]
        teacher = None if traj.teacher_logprobs is None else []
        return _Kept([pad_id], [], [], [], routed, traj.num_action_tokens, teacher, why_dropped=why)
    ranges, n_kept = [], 0
    for start, end in traj.action_ranges:
        if end <= cut:
            ranges.append((start, end))
            n_kept += end - start
    routed = None if traj.routed_experts is None else traj.routed_experts[:cut]
    return _Kept(
        tokens=traj.tokens[:cut],
        ranges=ranges,
        logprobs=traj.action_logprobs[:n_kept],
        versions=traj.versions[:n_kept],
        routed=routed,
        dropped=traj.num_action_tokens - n_kept,
        teacher=None if traj.teacher_logprobs is None else traj.teacher_logprobs[:n_kept],
        top=None if traj.teacher_top_ids is None else (traj.teacher_top_ids, traj.teacher_top_logprobs),
        images=kept_images(traj, cut) if vision is not None else [],
        segments=[s for s in traj.segments if s < cut],
    )


def pack_rows(lengths: list[int], capacity: int) -> list[list[int]]:
    """First-fit decreasing: sample indices per row, each row holding at most `capacity` tokens."""
    rows: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for r, room in enumerate(free):
            if lengths[i] <= room:
                rows[r].append(i)
                free[r] -= lengths[i]
                break
        else:
            rows.append([i])
            free.append(capacity - lengths[i])
    return rows


def _check_inputs(trajectories: Sequence[Trajectory], max_len: int, group_index: Sequence[int] | None) -> None:
    if not trajectories:
        raise ValueError("make_experience needs at least one trajectory")
    if max_len < 2:
        raise ValueError(f"max_len must be >= 2 (a prompt token and an action token), got {max_len}")
    if group_index is not None and len(group_index) != len(trajectories):
        raise ValueError(f"group_index has {len(group_index)} entries for {len(trajectories)} trajectories")
    for n, t in enumerate(trajectories):
        if t.action_ranges and t.action_ranges[0][0] < 1:
            raise ValueError(
                f"trajectory {n} ({t.rollout_id!r}) starts with an action at token 0: nothing predicts it; "
                "every trajectory needs a prompt of at least one token"
            )
    taught = sum(t.teacher_logprobs is not None for t in trajectories)
    if 0 < taught < len(trajectories):
        raise ValueError(
            f"{len(trajectories) - taught} of {len(trajectories)} trajectories lack the teacher's log-probs: a "
            "batch is distilled whole (every group scored by a teacher) or not at all"
        )
    shapes = {t.routed_experts.shape[1:] for t in trajectories if t.routed_experts is not None}
    if len(shapes) > 1:
        raise ValueError(
            f"the trajectories' routed experts differ in [layers, top_k]: {sorted(shapes)}; every engine must "
            "serve the trained model"
        )


def _group_indices(trajectories: Sequence[Trajectory]) -> list[int]:
    ids: dict[str, int] = {}
    return [ids.setdefault(t.group_id, len(ids)) for t in trajectories]


def _fill_rows(kept: list, layout: list[list[int]], lengths: list[int], pad_id: int) -> "_Rows":
    """The rows of `layout` (sample indices per row) filled with the kept samples, back to back."""
    t = max(sum(lengths[i] for i in row) for row in layout)
    top_k = max((len(k.top[0][0]) for k in kept if k.top is not None and k.top[0]), default=0)
    buf = _Rows.empty(len(layout), t, pad_id, _routed_shape(kept), bool(kept) and kept[0].teacher is not None, top_k)
    for r, row in enumerate(layout):
        off = 0
        for i in row:
            buf.place(r, off, i, kept[i])
            off += lengths[i]
        buf.position_ids[r, off:] = torch.arange(t - off)  # the padding block restarts too, so it stays apart
    return buf


def make_experience(
    trajectories: Sequence[Trajectory],
    *,
    max_len: int,
    pad_id: int = 0,
    pack: bool = False,
    group_index: Sequence[int] | None = None,
    vision: VisionSpec | None = None,
) -> Experience:
    """Tensors for training from trajectories (see the module docstring for the conventions).

    `max_len` caps a row (and so a sample); `pack=True` fills rows of `max_len` tokens with several
    samples (first-fit decreasing), otherwise one sample per right-padded row. `group_index` numbers
    the groups; by default samples with the same `group_id` share a group, in order of appearance.
    `vision` (a vision-language model's ids): the batch carries its images and multimodal positions.
    """
    _check_inputs(trajectories, max_len, group_index)
    if vision is None and any(t.images for t in trajectories):
        raise ValueError("trajectories carry images: make_experience needs the model's VisionSpec (vision=...)")
    kept = [_truncate(t, max_len, vision, pad_id) for t in trajectories]
    lengths = [len(k.tokens) for k in kept]
    layout = pack_rows(lengths, max_len) if pack else [[i] for i in range(len(kept))]
    b = len(layout)
    buf = _fill_rows(kept, layout, lengths, pad_id)
    truncated = torch.tensor([len(tr.tokens) > max_len for tr in trajectories], dtype=torch.bool)
    groups = list(group_index) if group_index is not None else _group_indices(trajectories)
    images = [k.images for k in kept] if vision is not None else None
    vlm = {}
    if vision is not None:
        vlm = {r: sum(1 for k in kept if k.why_dropped == r) for r in ("vlm_truncation", "media_token")}
    return Experience(
        sequences=buf.sequences,
        attention_mask=buf.seq_index >= 0,
        position_ids=buf.position_ids,
        seq_index=buf.seq_index,
        action_mask=buf.action_mask,
        action_log_probs=buf.action_log_probs,
        versions=buf.versions,
        reward=torch.tensor([tr.reward for tr in trajectories], dtype=torch.float32),
        group_index=torch.tensor(groups, dtype=torch.long),
        truncated=truncated,
        routed_experts=buf.routed_experts,
        teacher_log_probs=buf.teacher_log_probs,
        teacher_top_ids=buf.teacher_top_ids,
        teacher_top_log_probs=buf.teacher_top_log_probs,
        rope_position_ids=None if images is None else rope_rows(buf.position_ids, buf.seq_index, images, vision.merge),
        images=images,
        stats={
            "samples": len(kept),
            "rows": b,
            "truncated_samples": int(truncated.sum()),
            "dropped_action_tokens": sum(k.dropped for k in kept),
            "empty_samples": sum(1 for k in kept if not k.ranges),
            **vlm,
            "unrouted_samples": 0 if buf.routed_experts is None else sum(1 for k in kept if k.routed is None),
        },
    )


def _routed_shape(kept: list[_Kept]) -> tuple[int, int] | None:
    """(layers, top_k) of the routed experts, or None without router replay."""
    first = next((k.routed for k in kept if k.routed is not None), None)
    return None if first is None else tuple(first.shape[1:])


@dataclass
class _Rows:
    """The token tensors being filled, one sample at a time."""

    sequences: Tensor
    position_ids: Tensor
    seq_index: Tensor
    action_mask: Tensor
    action_log_probs: Tensor
    versions: Tensor
    routed_experts: Tensor | None
    teacher_log_probs: Tensor | None = None
    teacher_top_ids: Tensor | None = None
    teacher_top_log_probs: Tensor | None = None

    @classmethod
    def empty(cls, b: int, t: int, pad_id: int, routed: tuple | None, taught: bool = False, top_k: int = 0) -> "_Rows":
        return cls(
            sequences=torch.full((b, t), pad_id, dtype=torch.long),
            position_ids=torch.zeros((b, t), dtype=torch.long),
            seq_index=torch.full((b, t), -1, dtype=torch.long),
            action_mask=torch.zeros((b, t), dtype=torch.bool),
            action_log_probs=torch.zeros((b, t), dtype=torch.float32),
            versions=torch.full((b, t), -1, dtype=torch.long),
            routed_experts=None if routed is None else torch.full((b, t, *routed), -1, dtype=torch.int16),
            teacher_log_probs=torch.zeros((b, t), dtype=torch.float32) if taught else None,
            teacher_top_ids=torch.zeros((b, t, top_k), dtype=torch.long) if top_k else None,
            teacher_top_log_probs=torch.zeros((b, t, top_k), dtype=torch.float32) if top_k else None,
        )

    def place(self, r: int, off: int, i: int, k: _Kept) -> None:
        """Write sample `i` into row `r` from column `off`."""
        n = len(k.tokens)
        self.sequences[r, off : off + n] = _longs(k.tokens)
        self.position_ids[r, off : off + n] = _positions(n, k.segments)
        self.seq_index[r, off : off + n] = i
        if self.routed_experts is not None and k.routed is not None:
            self.routed_experts[r, off : off + n] = torch.from_numpy(k.routed)
        a = 0
        for start, end in k.ranges:
            span = slice(off + start, off + end)
            self.action_mask[r, span] = True
            self.action_log_probs[r, span] = _floats(k.logprobs[a : a + end - start])
            self.versions[r, span] = _longs(k.versions[a : a + end - start])
            if self.teacher_log_probs is not None:
                self.teacher_log_probs[r, span] = _floats(k.teacher[a : a + end - start])
            if self.teacher_top_ids is not None and k.top is not None:
                self.teacher_top_ids[r, span] = torch.tensor(k.top[0][a : a + end - start], dtype=torch.long)
                self.teacher_top_log_probs[r, span] = torch.tensor(k.top[1][a : a + end - start], dtype=torch.float32)
            a += end - start


def _positions(n: int, segments: list[int]) -> Tensor:
    """Position ids of a sample of `n` tokens: 0.. from its start and again from every segment start."""
    pos = torch.arange(n)
    for start in segments:
        pos[start:] -= pos[start].clone()
    return pos


# Python lists to tensors through `array` (a C loop): 3-6x faster than `torch.tensor(list)`, which
# was most of the trainer's per-step host work at 8 x 4096 tokens.
def _longs(values: Sequence[int]) -> Tensor:
    if not len(values):  # frombuffer refuses an empty buffer
        return torch.empty(0, dtype=torch.long)
    return torch.frombuffer(array.array("q", values), dtype=torch.int64)


def _floats(values: Sequence[float]) -> Tensor:
    if not len(values):
        return torch.empty(0)
    return torch.frombuffer(array.array("f", values), dtype=torch.float32)


def experience_from_groups(groups: Sequence[Group], **kwargs) -> Experience:
    """`make_experience` over every sample of `groups`, group g's samples getting `group_index == g`."""
    trajectories = [s for g in groups for s in g.samples]
    group_index = [gi for gi, g in enumerate(groups) for _ in g.samples]
    return make_experience(trajectories, group_index=group_index, **kwargs)
