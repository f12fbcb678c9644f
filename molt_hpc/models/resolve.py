"""`model.path` to an HF directory: a path is checked, a `builtin:` name is built (or converted) once
into the model cache (`cache.build_once`)."""

from collections.abc import Callable
from pathlib import Path

from molt_hpc.config.model import ModelConfig
from molt_hpc.models.cache import build_once
from molt_hpc.models.load import check_model_dir


def _tiny_char(cfg: ModelConfig, cache_dir: Path) -> Path:
    from molt_hpc.models.tiny_char import build_tiny

    return build_once(cache_dir, "tiny-char", cfg.tiny.model_dump(), lambda out: build_tiny(out, cfg.tiny))


def _tiny_moe(cfg: ModelConfig, cache_dir: Path) -> Path:
    from molt_hpc.models.tiny_moe import build_tiny_moe

    spec = cfg.tiny_moe
    return build_once(cache_dir, "tiny-moe", spec.model_dump(), lambda out: build_tiny_moe(out, spec))


def _tiny_vl(cfg: ModelConfig, cache_dir: Path) -> Path:
    from molt_hpc.models.tiny_vl import build_tiny_vl

    spec = cfg.tiny_vl
    return build_once(cache_dir, "tiny-vl", spec.model_dump(), lambda out: build_tiny_vl(out, spec))


def _smollm2(cfg: ModelConfig, cache_dir: Path) -> Path:
    from molt_hpc.models.gguf import resolve_smollm2

    return resolve_smollm2(cache_dir)


BUILTINS: dict[str, Callable[[ModelConfig, Path], Path]] = {
    "builtin:tiny-char": _tiny_char,
    "builtin:smollm2": _smollm2,
    "builtin:tiny-moe": _tiny_moe,
    "builtin:tiny-vl": _tiny_vl,
}
"""Every `builtin:` model: name -> function(model config, cache dir) -> its HF directory."""


def run_model(path: Path, part: str) -> Path:
    """`path`, or when it is a run directory with checkpoints, its latest checkpoint's `part`
    (`policy`, `reward`): a finished `molt-hpc sft` / `rm train` run is a model path as it is."""
    from molt_hpc.checkpoint import latest_checkpoint

    if (path / "config.json").is_file() or not (path / "checkpoints").is_dir():
        return path
    latest = latest_checkpoint(path / "checkpoints")
    if latest is None:
        raise ValueError(f"{path} is a run directory without a checkpoint yet; let its run finish, or name a model")
    if not (latest / part).is_dir():
        kinds = ", ".join(sorted(p.name for p in latest.iterdir() if (p / "config.json").is_file()))
        raise ValueError(f"{latest} holds no {part} model (it has: {kinds or 'none'}); name the right run directory")
    return latest / part


def resolve_model(cfg: ModelConfig, cache_dir: str | Path) -> Path:
    """The HF directory for `cfg.path` (a run directory: its latest policy); a builtin model is built
    once into `cache_dir` (atomically)."""
    if not cfg.is_builtin:
        path = run_model(Path(cfg.path).expanduser(), "policy")
        check_model_dir(path)
        return path
    if cfg.path not in BUILTINS:
        names = ", ".join(repr(n) for n in BUILTINS)
        raise ValueError(f"model.path = {cfg.path!r}: the builtin models are {names}")
    return BUILTINS[cfg.path](cfg, Path(cache_dir))


def builtin_config(cfg: ModelConfig):
    """The transformers config a builtin model is built from (no weights, nothing written), for
    `molt-hpc plan`; None for a builtin converted from an installed file (read its directory)."""
    if cfg.path == "builtin:tiny-char":
        from molt_hpc.models.tiny_char import tiny_config

        return tiny_config(cfg.tiny)
    if cfg.path == "builtin:tiny-moe":
        from molt_hpc.models.tiny_char import build_tiny_tokenizer
        from molt_hpc.models.tiny_moe import tiny_moe_config

        return tiny_moe_config(cfg.tiny_moe, build_tiny_tokenizer())
    if cfg.path == "builtin:tiny-vl":
        from molt_hpc.models.tiny_vl import build_tiny_vl_tokenizer, tiny_vl_config

        return tiny_vl_config(cfg.tiny_vl, build_tiny_vl_tokenizer())
    return None
