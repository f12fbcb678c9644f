"""The model cache: a deterministic model built once into a directory and published by an atomic rename.

Builtin models are deterministic functions of their config, so each is built once into the run's
model cache under a key of that config; processes that race to build the same model all end with the
same directory.
"""

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def build_once(
    cache_dir: Path, name: str, spec: dict | None, build: Callable[[Path], object], *, exact: bool = False
) -> Path:
    """`cache_dir/<name>-<hash of spec>` (`cache_dir/<name>` when `exact`), made by `build(tmp_dir)` on
    first use and renamed into place."""
    key = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]
    final = Path(cache_dir) / (name if exact else f"{name}-{key}")
    if (final / "config.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=final.parent))
    try:
        build(tmp)
        os.rename(tmp, final)
    except OSError:  # another process published the same deterministic model first
        shutil.rmtree(tmp, ignore_errors=True)
        if not (final / "config.json").is_file():
            raise
    except BaseException:  # a failed build leaves no half-written temp dir behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final
