"""One `Group` as one safetensors file: flat tensors with offsets plus a JSON metadata string.

Variable-length lists are concatenated over the group's samples and cut back by offsets
(`token_offsets[i]:token_offsets[i+1]` are sample i's tokens). Per-sample scalars (prompt length,
reward, score, finish reason, info, ids, a segmented trace's segment starts) and the group's own
fields go to safetensors' `__metadata__` map under the key `molt`, as one JSON string, so one rename
publishes everything.

Images (vision-language models) are stored once per group: each distinct image's bytes once
(`image_bytes`, cut by `image_byte_offsets`; a group's samples share their prompt's images), and per
sample its placements, rows of (image, offset, length, t, h, w) in `image_refs` cut by `image_offsets`.
A group without images has none of these tensors.

Precision: token ids and policy versions are stored as int32 (every vocabulary fits), log-probs (the
engine's, and a teacher's under `[distill]`, laid out alike) as float32 (what engines and teachers compute
in), routed experts as int16 (their in-memory dtype: the raw bytes, -1 for unknown), rewards and scores
exactly (JSON floats).
Numpy only: producers and consumers never need torch to move groups.
"""

import hashlib
import itertools
import json
from itertools import chain
from typing import Any

import numpy as np
from safetensors.numpy import load, save

from molt_hpc.trajectory import ROUTING_DTYPE, Group, TraceImage, Trajectory

FORMAT = "molt-hpc/group"
FORMAT_VERSION = 1
META_KEY = "molt"
INT32_MAX = 2**31 - 1


def _offsets(lengths: list[int]) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64)


def _flat(lists: list[list], dtype: type) -> np.ndarray:
    return np.fromiter(chain.from_iterable(lists), dtype=dtype, count=sum(map(len, lists)))


def _int32(group: Group, what: str, lists: list[list[int]]) -> np.ndarray:
    flat = _flat(lists, np.int64)
    if flat.size and (flat.min() < 0 or flat.max() > INT32_MAX):
        raise ValueError(f"group {group.group_id}: {what} must lie in [0, 2^31); got {flat.min()}..{flat.max()}")
    return flat.astype(np.int32)


def _experts(samples: list[Trajectory]) -> dict[str, np.ndarray]:
    """Routed experts `[rows, layers, top_k]` int16 of all samples that have them (their raw bytes,
    concatenated), with per-sample row offsets."""
    arrays = [s.routed_experts for s in samples if s.routed_experts is not None]
    if not arrays:
        return {}
    shapes = {a.shape[1:] for a in arrays}
    if len(shapes) > 1:
        raise ValueError(f"the samples' routed experts differ in [layers, top_k]: {sorted(shapes)}")
    rows = [0 if s.routed_experts is None else len(s.routed_experts) for s in samples]
    flat = np.concatenate(arrays).astype(ROUTING_DTYPE, copy=False)
    return {"experts": flat, "expert_offsets": _offsets(rows)}


def _images(samples: list[Trajectory]) -> dict[str, np.ndarray]:
    """Every distinct image of the group once, and each sample's placements of them."""
    if not any(s.images for s in samples):
        return {}
    index: dict[bytes, int] = {}
    blobs: list[bytes] = []
    refs: list[list[int]] = []
    for s in samples:
        for im in s.images:
            key = hashlib.sha256(im.data).digest()
            if key not in index:
                index[key] = len(blobs)
                blobs.append(im.data)
            refs.append([index[key], im.offset, im.length, *im.grid])
    return {
        "image_bytes": np.frombuffer(b"".join(blobs), dtype=np.uint8),
        "image_byte_offsets": _offsets([len(b) for b in blobs]),
        "image_refs": np.asarray(refs, dtype=np.int64).reshape(-1, 6),
        "image_offsets": _offsets([len(s.images) for s in samples]),
    }


def _decode_images(t: dict[str, np.ndarray], n: int) -> list[list[TraceImage]]:
    if "image_offsets" not in t:
        return [[] for _ in range(n)]
    offs, byte_offs = t["image_offsets"], t["image_byte_offsets"]
    if offs.shape != (n + 1,) or offs[-1] != len(t["image_refs"]) or byte_offs[-1] != len(t["image_bytes"]):
        raise ValueError("image offsets do not cover the image tensors")
    raw = t["image_bytes"].tobytes()
    blobs = [raw[int(a) : int(b)] for a, b in itertools.pairwise(byte_offs)]  # one bytes each
    return [
        [
            TraceImage(blobs[int(u)], int(o), int(k), (int(gt), int(gh), int(gw)))
            for u, o, k, gt, gh, gw in _cut(t["image_refs"], offs, i)
        ]
        for i in range(n)
    ]


def _teacher(group: Group) -> dict[str, np.ndarray]:
    """The teacher's log-prob of every action token (`[distill]`), laid out like `action_logprobs`: a group is
    scored whole, so all its samples have them or none does."""
    have = [s.teacher_logprobs is not None for s in group.samples]
    if not any(have):
        return {}
    if not all(have):
        raise ValueError(f"group {group.group_id}: {have.count(False)} sample(s) lack the teacher's log-probs")
    out = {"teacher_logprobs": _flat([s.teacher_logprobs for s in group.samples], np.float32)}
    if group.samples[0].teacher_top_ids is not None:  # `distill.top_k`: [action tokens, k] each
        out["teacher_top_ids"] = np.asarray([r for s in group.samples for r in s.teacher_top_ids], np.int32)
        out["teacher_top_logprobs"] = np.asarray([r for s in group.samples for r in s.teacher_top_logprobs],
                                                 np.float32)  # fmt: skip
    return out


def _teacher_arrays(t: dict[str, np.ndarray]) -> tuple:
    """(teacher log-probs, top ids, top log-probs) of a group file, each None when absent, checked against
    the action tokens (`versions`)."""
    teacher = t.get("teacher_logprobs")
    if teacher is not None and len(teacher) != len(t["versions"]):
        raise ValueError("one teacher log-prob per action token is required")
    top_ids, top = t.get("teacher_top_ids"), t.get("teacher_top_logprobs")
    if (top_ids is None) != (top is None) or (top is not None and (top.shape != top_ids.shape or teacher is None
                                                                   or len(top) != len(teacher))):  # fmt: skip
        raise ValueError("the teacher's top ids and log-probs come together, one row per action token")
    return teacher, top_ids, top


def encode_group(group: Group) -> bytes:
    """The safetensors bytes of `group` (tensors + `__metadata__`)."""
    samples = group.samples
    tokens = _int32(group, "token ids", [s.tokens for s in samples])
    versions = _int32(group, "policy versions", [s.versions for s in samples])
    tensors = {
        "tokens": tokens,
        "token_offsets": _offsets([len(s.tokens) for s in samples]),
        "action_ranges": _flat([list(chain.from_iterable(s.action_ranges)) for s in samples], np.int64).reshape(-1, 2),
        "range_offsets": _offsets([len(s.action_ranges) for s in samples]),
        "action_logprobs": _flat([s.action_logprobs for s in samples], np.float32),
        "versions": versions,
        **_experts(samples),
        **_images(samples),
        **_teacher(group),
    }
    meta = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "group_id": group.group_id,
        "prompt_id": group.prompt_id,
        "data_position": group.data_position,
        "meta": group.meta,
        "min_version": int(versions.min()) if versions.size else 0,  # == group.min_version, without a Python loop
        "samples": [
            {
                "prompt_len": s.prompt_len,
                "reward": s.reward,
                "score": s.score,
                "finish_reason": s.finish_reason,
                "info": s.info,
                "group_id": s.group_id,
                "rollout_id": s.rollout_id,
                "has_experts": s.routed_experts is not None,
                **({"segments": s.segments} if s.segments else {}),
            }
            for s in samples
        ],
    }
    return save(tensors, metadata={META_KEY: json.dumps(meta)})


def read_metadata(data: bytes) -> dict[str, Any]:
    """The `molt` metadata of a group file's bytes; ValueError when it is not a group file."""
    if len(data) < 8:
        raise ValueError(f"{len(data)} bytes is too short for a safetensors header")
    size = int.from_bytes(data[:8], "little")
    if size > len(data) - 8:
        raise ValueError(f"header of {size} bytes overruns the {len(data)}-byte file")
    header = json.loads(data[8 : 8 + size])
    text = (header.get("__metadata__") or {}).get(META_KEY)
    if text is None:
        raise ValueError(f"no `{META_KEY}` metadata: not a molt-hpc group file")
    meta = json.loads(text)
    if meta.get("format") != FORMAT or meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"format {meta.get('format')!r} v{meta.get('format_version')}, expected {FORMAT} v1")
    return meta


def _cut(flat: np.ndarray, offsets: np.ndarray, i: int) -> np.ndarray:
    return flat[int(offsets[i]) : int(offsets[i + 1])]


def decode_group(data: bytes) -> Group:
    """The `Group` in a group file's bytes; raises (ValueError, AssertionError, ...) on a bad file."""
    meta = read_metadata(data)
    t = load(data)
    n = len(meta["samples"])
    for key in ("token_offsets", "range_offsets"):
        offs = t[key]
        if offs.shape != (n + 1,) or offs[0] != 0 or np.any(np.diff(offs) < 0):
            raise ValueError(f"bad {key} {offs.tolist()} for {n} samples")
    if t["token_offsets"][-1] != len(t["tokens"]) or t["range_offsets"][-1] != len(t["action_ranges"]):
        raise ValueError("offsets do not cover the flat tensors")
    if len(t["action_logprobs"]) != len(t["versions"]):
        raise ValueError("one log-prob and one version per action token are required")
    teacher, top_ids, top = _teacher_arrays(t)
    if meta["min_version"] != (int(t["versions"].min()) if t["versions"].size else 0):
        raise ValueError(f"metadata says min_version {meta['min_version']}, the versions tensor disagrees")
    samples, action_at = [], 0
    images = _decode_images(t, n)
    for i, sm in enumerate(meta["samples"]):
        ranges = [(int(a), int(b)) for a, b in _cut(t["action_ranges"], t["range_offsets"], i)]
        n_action = sum(b - a for a, b in ranges)
        experts = None
        if sm["has_experts"]:
            experts = _cut(t["experts"], t["expert_offsets"], i).astype(ROUTING_DTYPE)  # a copy it owns
        samples.append(
            Trajectory(
                tokens=_cut(t["tokens"], t["token_offsets"], i).tolist(),
                prompt_len=sm["prompt_len"],
                action_ranges=ranges,
                action_logprobs=t["action_logprobs"][action_at : action_at + n_action].tolist(),
                versions=t["versions"][action_at : action_at + n_action].tolist(),
                reward=sm["reward"],
                score=sm["score"],
                finish_reason=sm["finish_reason"],
                info=sm["info"],
                group_id=sm["group_id"],
                rollout_id=sm["rollout_id"],
                routed_experts=experts,
                images=images[i],
                segments=[int(x) for x in sm.get("segments", [])],
                teacher_logprobs=None if teacher is None else teacher[action_at : action_at + n_action].tolist(),
                teacher_top_ids=None if top_ids is None else top_ids[action_at : action_at + n_action].tolist(),
                teacher_top_logprobs=None if top is None else top[action_at : action_at + n_action].tolist(),
            )
        )
        action_at += n_action
    if action_at != len(t["versions"]):
        raise ValueError(f"{len(t['versions'])} action tokens stored, the ranges cover {action_at}")
    return Group(
        group_id=meta["group_id"],
        prompt_id=meta["prompt_id"],
        samples=samples,
        data_position=meta["data_position"],
        meta=meta["meta"],
    )
