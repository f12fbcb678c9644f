"""The model cache: a deterministic model built once into a directory and published by an atomic rename.

Builtin models are deterministic functions of their config, so each is built once into the run's
model cache under a key of that config; processes that race to build the same model all end with the
same directory. A run's copy comes from the user's cache of built models (`MOLT_HPC_CACHE`, else
`~/.cache/molt-hpc/models`; `MOLT_HPC_CACHE=` turns it off), keyed by the config, the versions of the
libraries that write the files and the source of this package: a second run of the same model copies a few
files instead of importing the modeling code and building (2-3 CPU seconds a tiny run; a GGUF conversion's
12-14 s).
"""

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

LIBRARIES = ("torch", "transformers", "tokenizers", "safetensors", "gguf")
"""The distributions whose versions are part of a user-cache key (they write or convert the files)."""


def build_once(
    cache_dir: Path, name: str, spec: dict | None, build: Callable[[Path], object], *, exact: bool = False
) -> Path:
    """`cache_dir/<name>-<hash of spec>` (`cache_dir/<name>` when `exact`), made by `build(tmp_dir)` on
    first use and renamed into place."""
    key = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]
    final = Path(cache_dir) / (name if exact else f"{name}-{key}")
    if (final / "config.json").is_file():
        return final
    shared = None if exact else user_cache()
    if shared is not None:  # built once for the user, copied into each run (the run's copy is its own)
        built = build_once(shared, f"{name}-{key}-{stamp()}", None, build, exact=True)
        build = lambda out: shutil.copytree(built, out, dirs_exist_ok=True)  # noqa: E731
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


def user_cache() -> Path | None:
    """The user's cache of built models, made private on first use; None when `MOLT_HPC_CACHE` is set empty
    or the directory cannot be made (then each run builds its own)."""
    env = os.environ.get("MOLT_HPC_CACHE")
    if env == "":
        return None
    root = (
        Path(env) if env else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "molt-hpc" / "models"
    )
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError:
        return None
    return root


def stamp() -> str:
    """What besides the config decides a built model's bytes: the versions of `LIBRARIES` and this package's
    source (a changed builder is a new key)."""
    digest = hashlib.sha256()
    for dist in LIBRARIES:
        try:
            digest.update(f"{dist}={metadata.version(dist)};".encode())
        except metadata.PackageNotFoundError:
            digest.update(f"{dist}=none;".encode())
    for source in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(source.read_bytes())
    return digest.hexdigest()[:12]
