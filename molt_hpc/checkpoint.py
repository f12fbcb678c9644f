"""Checkpoint directories on disk: layout, HF-layout weight shards, manifest, atomic publication, pruning.

    checkpoints/
      step_000010/
        policy/        HF layout: model-0000i-of-0000n.safetensors + index, config, tokenizer files
        critic/        the same for the critic (GAE only)
        optim/         optimizer state (torch DCP, one file per rank; reshards onto another world size)
        run_state.json step, policy version, RNG states of every rank, scheduler, buffer and data positions
        manifest.json  size and sha256 of every other file (written last)
      latest           the name of the newest whole checkpoint, replaced atomically
      best             {"checkpoint", "version", "metric", "value"} of the best-evaluated one (`[eval]`)
      .eval_pin        the name of the checkpoint an evaluation in progress may make best
      .lock            serialises `best`, the pin and pruning (the trainer prunes, the orchestrator promotes)
      .tmp.step_000011 a checkpoint being written (a crash leaves it; the next save removes it)

This module owns the files and knows nothing of process groups: the trainer gathers the tensors and
calls these functions on rank 0. A checkpoint is whole once `latest` names it; everything a load
reads is verified against the manifest first, so a torn or corrupt file fails with its name before
anything is loaded.

`best` is exact: it only ever names a whole checkpoint of the very policy its evaluation sampled. The
orchestrator pins the checkpoint name of the version it starts evaluating (it may not be written yet),
and when the evaluation ends it calls `promote_best`, which, under the lock, replaces `best` (one atomic
write) only if that checkpoint exists whole and the value beats the one `best` holds. Pruning, under the
same lock, never deletes what `latest`, `best` or the pin name. An evaluation whose tokens came from more
than one policy version (a refit landed while it ran) is recorded but never made best.
"""

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from molt_hpc.rundir import atomic_write, fsync_dir

LATEST = "latest"
BEST = "best"
PIN = ".eval_pin"
LOCK = ".lock"
MANIFEST = "manifest.json"
RUN_STATE = "run_state.json"
INDEX = "model.safetensors.index.json"
TMP_PREFIX = ".tmp."
# Files of an HF model directory that are not weights and travel with every checkpoint.
TOKENIZER_GLOBS = (
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab*",
    "merges.txt",
    "*.jinja",
    "*.model",
    "*.tiktoken",
    "preprocessor_config.json",
    "processor_config.json",
)


def step_name(step: int) -> str:
    return f"step_{step:06d}"


def temp_dir(root: Path, step: int) -> Path:
    return Path(root) / f"{TMP_PREFIX}{step_name(step)}"


def latest_checkpoint(root: str | Path) -> Path | None:
    """The checkpoint `latest` names, or None when there is none yet."""
    pointer = Path(root) / LATEST
    if not pointer.is_file():
        return None
    path = Path(root) / pointer.read_text().strip()
    if not (path / MANIFEST).is_file():
        raise ValueError(f"{pointer} names {path.name}, which is not a whole checkpoint (no {MANIFEST})")
    return path


def begin(root: Path, step: int) -> Path:
    """A fresh temporary directory for the checkpoint of `step`; leftovers of interrupted saves go."""
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(f"{TMP_PREFIX}*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = temp_dir(root, step)
    tmp.mkdir(mode=0o700)
    return tmp


def shard_name(index: int, total: int) -> str:
    return f"model-{index + 1:05d}-of-{total:05d}.safetensors"


def write_shard(model_dir: Path, index: int, total: int, tensors: dict) -> dict[str, str]:
    """Write one safetensors shard of an HF-layout model; returns its part of the index's weight map."""
    from safetensors.torch import save_file

    name = shard_name(index, total)
    model_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(model_dir / name), metadata={"format": "pt"})
    return dict.fromkeys(tensors, name)


def write_index(model_dir: Path, weight_map: dict[str, str], total_bytes: int) -> None:
    index = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
    (model_dir / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def copy_tokenizer_files(src: Path, dst: Path) -> None:
    """Copy the tokenizer (and processor) files of an HF model directory, byte for byte."""
    dst.mkdir(parents=True, exist_ok=True)
    for pattern in TOKENIZER_GLOBS:
        for f in sorted(Path(src).glob(pattern)):
            if f.is_file():
                shutil.copyfile(f, dst / f.name)


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _files(ckpt: Path) -> list[Path]:
    return sorted(p for p in ckpt.rglob("*") if p.is_file() and p.name != MANIFEST)


def _hashes(files: list[Path]) -> list[str]:
    """sha256 of each file, several at a time (hashlib releases the GIL on large reads)."""
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        return list(pool.map(_sha256, files))


def _fsync(path: Path) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def write_manifest(ckpt: Path) -> None:
    """Record size and sha256 of every file, fsync them all, then write the manifest itself."""
    files = _files(ckpt)
    for f in files:
        _fsync(f)
    entries = {
        str(f.relative_to(ckpt)): {"bytes": f.stat().st_size, "sha256": digest}
        for f, digest in zip(files, _hashes(files), strict=True)
    }
    for d in sorted({f.parent for f in files} | {ckpt}):
        fsync_dir(d)
    atomic_write(ckpt / MANIFEST, json.dumps({"files": entries}, indent=1, sort_keys=True) + "\n")


def verify(ckpt: Path) -> None:
    """Every file the manifest lists is present, of its size and hash; safetensors headers are sound."""
    manifest = ckpt / MANIFEST
    if not manifest.is_file():
        raise ValueError(f"{ckpt} is not a whole checkpoint: {MANIFEST} is missing")
    entries = sorted(json.loads(manifest.read_text())["files"].items())
    for rel, meta in entries:
        f = ckpt / rel
        if not f.is_file():
            raise ValueError(f"checkpoint file {f} is missing; the checkpoint is incomplete")
        if f.stat().st_size != meta["bytes"]:
            raise ValueError(f"checkpoint file {f} has {f.stat().st_size} bytes, the manifest says {meta['bytes']}")
        if f.suffix == ".safetensors":
            safetensors_shapes(f)
    for (rel, meta), digest in zip(entries, _hashes([ckpt / rel for rel, _ in entries]), strict=True):
        if digest != meta["sha256"]:
            raise ValueError(f"checkpoint file {ckpt / rel} is corrupt: its sha256 differs from the manifest")


def safetensors_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name → shape from a safetensors header, after checking the header against the file size."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if n < 2 or 8 + n > size:
            raise ValueError(f"{path} is not a valid safetensors file (truncated or not safetensors)")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError):  # reported as the corrupt file it is
            raise ValueError(f"{path} is not a valid safetensors file (its header is not JSON)") from None
    header.pop("__metadata__", None)
    end = max((meta["data_offsets"][1] for meta in header.values()), default=0)
    if 8 + n + end != size:
        raise ValueError(f"{path} is corrupt: its header describes {8 + n + end} bytes but the file has {size}")
    return {name: tuple(meta["shape"]) for name, meta in header.items()}


def model_shapes(model_dir: Path) -> dict[str, tuple[tuple[int, ...], Path]]:
    """Name → (shape, file) of every tensor of an HF model directory (sharded or single file)."""
    index = model_dir / INDEX
    files = (
        sorted({model_dir / f for f in json.loads(index.read_text())["weight_map"].values()})
        if index.is_file()
        else sorted(model_dir.glob("*.safetensors"))
    )
    if not files:
        raise ValueError(f"{model_dir} has no safetensors weights")
    out = {}
    for f in files:
        if not f.is_file():
            raise ValueError(f"{index} lists {f.name}, which does not exist")
        out.update({name: (shape, f) for name, shape in safetensors_shapes(f).items()})
    return out


def check_shapes(model_dir: Path, expected: dict[str, tuple[int, ...]]) -> None:
    """Refuse weights whose names or shapes differ from the model's, naming the file and the tensor."""
    found = model_shapes(model_dir)
    missing = sorted(set(expected) - set(found))
    if missing:
        raise ValueError(f"{model_dir} lacks {len(missing)} tensors of the model, e.g. {missing[0]}: another model?")
    for name, shape in expected.items():
        got, f = found[name]
        if tuple(got) != tuple(shape):
            raise ValueError(
                f"{f}: tensor {name} has shape {list(got)} but the model has {list(shape)}; "
                "this checkpoint is from another model"
            )
    extra = sorted(set(found) - set(expected))
    if extra:
        raise ValueError(
            f"{found[extra[0]][1]}: tensor {extra[0]} is not in the model; this checkpoint is from another model"
        )


def publish(root: Path, tmp: Path, step: int, keep_last: int) -> Path:
    """Make the checkpoint in `tmp` whole: rename to its final name, point `latest` at it, prune old ones."""
    final = root / step_name(step)
    if final.exists():  # a checkpoint of the same step that `latest` no longer names (a rerun after a crash)
        assert latest_checkpoint(root) != final, f"{final} is the latest checkpoint; it is not replaced"
        with _locked(root):  # its evaluation was of the policy it held, not of the one replacing it
            if best_checkpoint(root) == final:
                (root / BEST).unlink()
            shutil.rmtree(final)
    os.rename(tmp, final)
    fsync_dir(root)
    atomic_write(root / LATEST, final.name + "\n")
    prune(root, keep_last)
    return final


@contextlib.contextmanager
def _locked(root: Path):
    """An exclusive lock on the checkpoint directory (flock: held by a process, released when it dies)."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / LOCK, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def prune(root: Path, keep_last: int) -> list[Path]:
    """Delete whole checkpoints beyond the newest `keep_last`, never one `latest`, `best` or the pin names."""
    with _locked(root):
        latest = latest_checkpoint(root)
        best = read_best(root)
        kept = {latest, root / best["checkpoint"] if best else None}
        if (root / PIN).is_file():
            kept.add(root / (root / PIN).read_text().strip())
        steps = sorted(p for p in root.glob("step_*") if p.is_dir())
        doomed = [p for p in steps[:-keep_last] if p not in kept]
        for p in doomed:
            shutil.rmtree(p, ignore_errors=True)
    return doomed


def read_best(root: str | Path) -> dict[str, Any] | None:
    """The `best` record (`checkpoint`, `version`, `metric`, `value`), or None when there is none yet."""
    pointer = Path(root) / BEST
    return json.loads(pointer.read_text()) if pointer.is_file() else None


def best_checkpoint(root: str | Path) -> Path | None:
    """The checkpoint `best` names, or None."""
    best = read_best(root)
    return None if best is None else Path(root) / best["checkpoint"]


def pin(root: Path, version: int) -> None:
    """Keep the checkpoint of `version` from pruning while its evaluation runs (one pin at a time)."""
    with _locked(root):
        atomic_write(root / PIN, step_name(version) + "\n")


def promote_best(root: Path, version: int, metric: str, value: float) -> bool | None:
    """Make the checkpoint of `version` the best when it exists whole and `value` beats the best's; unpin it.
    True when `best` now names it, False when it lost to `best`, None when `version` has no whole checkpoint
    (nothing could be kept, so nothing was compared)."""
    with _locked(root):
        (root / PIN).unlink(missing_ok=True)
        ckpt = root / step_name(version)
        if not (ckpt / MANIFEST).is_file():
            return None
        best = read_best(root)
        if best is not None and best["metric"] == metric and best["value"] >= value:
            return False
        record = {"checkpoint": ckpt.name, "version": version, "metric": metric, "value": value}
        atomic_write(root / BEST, json.dumps(record) + "\n")
    return True


def read_run_state(ckpt: Path) -> dict[str, Any]:
    return json.loads((ckpt / RUN_STATE).read_text())
