"""Pre-flight: what a run needs, checked before any process starts (`run`) or any job is queued
(`submit`, `sbatch`, `submit --dry-run`).

`preflight(cfg)` first resolves every relative path against the working directory, so the config a
run directory keeps (and a Slurm job reads on another node, from another directory) names the same
files by absolute path. Then, cheapest first: the files and directories the config names, the agent
(imports, declares one agent), the model (directory, config, weights, tokenizer; a vision-language
model's image processor), the data (the first rows parse with the configured keys and render through
the chat template, their images load and expand; prompts over `data.max_prompt_tokens`). A supervised
stage checks its own files instead of the prompts and the agent, and a `[reward_model]` is checked
against the policy (`preflight_stages`). Every failure is one `PreflightError` line: the key, what is
wrong, the fix.
"""

import contextlib
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from molt_hpc.config import ConfigError, MoltConfig
from molt_hpc.config.load import validate
from molt_hpc.launch.preflight_data import check_rows
from molt_hpc.launch.preflight_lora import check_lora
from molt_hpc.launch.preflight_stages import (
    absolute_stage_paths,
    check_reward_model_section,
    check_stage_files,
    check_stage_rows,
)
from molt_hpc.launch.procs import REPO

WEIGHT_GLOBS = ("*.safetensors", "pytorch_model*.bin", "*.safetensors.index.json")


class PreflightError(ConfigError):
    """The run cannot start as configured; the message names the key and the fix."""


def is_file_spec(agent: str) -> bool:
    """Whether `rollout.agent` names a file (as the agent loader reads it) rather than a module."""
    return agent.endswith(".py") or "/" in agent


def _absolute(path: str, base: Path) -> str:
    p = Path(path).expanduser()
    return str(p if p.is_absolute() else base / p)


def resolve_paths(cfg: MoltConfig, cwd: Path) -> MoltConfig:
    """`cfg` with every relative path made absolute: files against `cwd`, job scripts against the checkout."""
    data = cfg.model_dump()
    data["run"]["root"] = _absolute(cfg.run.root, cwd)
    data["data"]["path"] = _absolute(cfg.data.path, cwd)
    if cfg.data.eval is not None:
        data["data"]["eval"]["path"] = _absolute(cfg.data.eval.path, cwd)
    if is_file_spec(cfg.rollout.agent):
        data["rollout"]["agent"] = _absolute(cfg.rollout.agent, cwd)
    if not cfg.model.is_builtin:
        data["model"]["path"] = _absolute(cfg.model.path, cwd)
    for key in ("actor_script", "engine_script"):
        data["slurm"][key] = _absolute(getattr(cfg.slurm, key), REPO)
    absolute_stage_paths(data, cfg, lambda p: _absolute(p, cwd))
    return validate(data, "the config with absolute paths")


def _where(original: str, cwd: Path) -> str:
    """How a relative path was read, for a message about it."""
    rel = not Path(original).expanduser().is_absolute()
    return f" (relative paths are taken from the working directory, {cwd})" if rel else ""


def check_file(key: str, original: str, resolved: str, cwd: Path, fix: str) -> None:
    path = Path(resolved)
    if not path.exists():
        raise PreflightError(f"{key} = {original!r}: {path} does not exist{_where(original, cwd)}; {fix}")
    if not path.is_file():
        raise PreflightError(f"{key} = {original!r}: {path} is not a file; {fix}")


def check_run_root(cfg: MoltConfig, original: str, cwd: Path) -> None:
    root = Path(cfg.run.root)
    existing = next(p for p in (root, *root.parents) if p.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise PreflightError(
            f"run.root = {original!r}: run directories cannot be made under {root}{_where(original, cwd)} "
            f"({existing} is not a writable directory); point run.root at a directory you can write"
        )


def check_agent(cfg: MoltConfig, original: str, cwd: Path) -> None:
    from molt_hpc.agents.loader import load_agent

    spec = cfg.rollout.agent
    if is_file_spec(original):
        check_file("rollout.agent", original, spec, cwd, "give the .py file of your Env (see envs/)")
    where = f"rollout.agent = {original!r}"
    try:
        load_agent(spec)
    except SyntaxError as err:
        raise PreflightError(
            f"{where}: {err.filename} does not compile: {err.msg} (line {err.lineno}); fix it"
        ) from None
    except ValueError as err:
        text = str(err)
        raise PreflightError(text if text.startswith("rollout.agent") else f"{where}: {text}") from None
    except Exception as err:  # whatever the user's module raised at import: name it, no traceback
        raise PreflightError(f"{where}: importing it raised {type(err).__name__}: {err}; fix the module") from None


def is_vision(cfg: MoltConfig) -> bool:
    """Whether the configured model takes images (read from its config.json alone; no model is built)."""
    from molt_hpc.vision.spec import is_vision_model

    if cfg.model.is_builtin:
        return cfg.model.path == "builtin:tiny-vl"
    try:
        return is_vision_model(Path(cfg.model.path))
    except (OSError, ValueError):  # unreadable: check_model says what is wrong with the directory
        return False


def check_model(cfg: MoltConfig, original: str, cwd: Path) -> tuple[Any, Any]:
    """(the tokenizer the run will use, when it can be had without building or converting a model; a
    vision-language model's `Vision`, else None)."""
    from molt_hpc.models import BUILTINS

    path = cfg.model.path
    if cfg.model.is_builtin:
        if path not in BUILTINS:
            names = ", ".join(repr(n) for n in BUILTINS)
            raise PreflightError(f"model.path = {path!r} is not a builtin model: the builtin models are {names}")
        if path == "builtin:tiny-vl":  # tiny-char's tokenizer plus the vision tokens, and its image processor
            from molt_hpc.models.tiny_vl import build_tiny_vl_tokenizer, tiny_vl_vision

            return build_tiny_vl_tokenizer(), tiny_vl_vision(cfg.model.tiny_vl)
        if path != "builtin:smollm2":  # the other tiny models are built from a config with the tiny-char tokenizer
            from molt_hpc.models import build_tiny_tokenizer

            return build_tiny_tokenizer(), None
        from molt_hpc.models.gguf import SMOLLM2_DIST, find_package_gguf, require_gguf

        try:
            require_gguf()
            find_package_gguf(SMOLLM2_DIST)
        except ValueError as err:
            raise PreflightError(f"model.path = {path!r}: {err}") from None
        return None, None  # its tokenizer comes with the one-time conversion at the run's start
    from molt_hpc.models.resolve import run_model

    fix = "point it at a Hugging Face model directory (config.json, safetensors, tokenizer) or use builtin:tiny-char"
    try:
        model_dir = run_model(Path(path), "policy")  # a finished `molt-hpc sft` run: its latest policy
    except ValueError as err:
        raise PreflightError(f"model.path = {original!r}: {err}") from None
    if not model_dir.is_dir():
        raise PreflightError(f"model.path = {original!r}: {model_dir} does not exist{_where(original, cwd)}; {fix}")
    if not (model_dir / "config.json").is_file():
        raise PreflightError(f"model.path = {original!r}: {model_dir} has no config.json; {fix}")
    if not any(next(model_dir.glob(g), None) for g in WEIGHT_GLOBS):
        raise PreflightError(f"model.path = {original!r}: {model_dir} has no weights (*.safetensors); {fix}")
    from transformers import AutoConfig

    from molt_hpc.models import load_tokenizer
    from molt_hpc.vision.processor import Vision

    try:
        AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
        tokenizer = load_tokenizer(model_dir)
    except Exception as err:  # transformers raises many kinds; the user needs the message, not the trace
        first = next(iter(str(err).strip().splitlines()), type(err).__name__)
        raise PreflightError(f"model.path = {original!r}: transformers cannot load {model_dir}: {first}") from None
    try:
        return tokenizer, Vision.of(model_dir)
    except Exception as err:  # a vision-language model without a loadable image processor
        first = next(iter(str(err).strip().splitlines()), type(err).__name__)
        raise PreflightError(f"model.path = {original!r}: its image processor does not load: {first}") from None


def check_vision(cfg: MoltConfig, vision: Any) -> None:
    """What a vision-language model cannot run with here, refused before anything starts."""
    if vision is None:
        return
    if cfg.algorithm.uses_critic:
        raise PreflightError(
            f"algorithm.advantage = {cfg.algorithm.advantage!r} trains a critic, which a vision-language model "
            f"({cfg.model.path}) has no value head for here: use a critic-free advantage (grpo, rloo, ...)"
        )


def check_scripts(cfg: MoltConfig) -> None:
    for key in ("actor_script", "engine_script"):
        path = Path(getattr(cfg.slurm, key))
        if not path.is_file():
            raise PreflightError(f"slurm.{key} = {str(path)!r} does not exist; leave it unset or give the script")


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


def preflight(cfg: MoltConfig, cwd: str | Path | None = None, warn: Callable[[str], None] = _warn) -> MoltConfig:
    """Check `cfg` against the filesystem; the config with absolute paths, or a `PreflightError`.
    What does not stop the run (rows that `data.on_bad_row = "skip"` will skip) goes to `warn`."""
    cwd = Path(cwd or os.getcwd()).absolute()
    resolved = resolve_paths(cfg, cwd)
    check_run_root(resolved, cfg.run.root, cwd)
    check_scripts(resolved)
    from molt_hpc.trackers import check_optional_packages

    try:
        check_optional_packages(resolved)  # trackers and router kinds that need a package
    except ValueError as err:
        raise PreflightError(str(err)) from None
    rl = resolved.run.stage == "rl"  # a stage reads its own files, not the prompts and the agent
    files = [("data.path", cfg.data.path, resolved.data.path)] if rl else []
    if rl and cfg.data.eval is not None:
        files.append(("data.eval.path", cfg.data.eval.path, resolved.data.eval.path))
    for key, original, path in files:  # the rows' shape first: it needs no tokenizer, so a wrong key fails fast
        check_file(key, original, path, cwd, "give an existing JSONL file of prompts")
        check_rows(resolved.data, None, path, key, vision=is_vision(resolved))
    check_stage_files(resolved, cfg, cwd)
    if rl:
        check_agent(resolved, cfg.rollout.agent, cwd)
    tokenizer, vision = check_model(resolved, cfg.model.path, cwd)
    check_vision(resolved, vision)
    check_lora(resolved, PreflightError)
    for key, _, path in files:
        for warning in check_rows(resolved.data, tokenizer, path, key, vision=vision):
            warn(warning)
    check_stage_rows(resolved, tokenizer, vision)
    check_reward_model_section(resolved, cfg, tokenizer)
    return resolved


def _runs(pid: int, run_dir: Path) -> bool:
    """Whether `pid` is alive and working on `run_dir` (a reused pid of another program is not)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return str(run_dir).encode() in cmdline or b"molt-hpc" in cmdline


def check_resume(run_dir: Path, cfg: MoltConfig) -> None:
    """A run directory `--resume` can continue: not running now, its checkpoint whole, steps left to train."""
    import json

    from molt_hpc import checkpoint as ck

    alive: list[tuple[str, int]] = []
    with contextlib.suppress(ValueError, OSError, AttributeError):  # no or a torn record: nothing runs
        recorded = json.loads((run_dir / "processes.json").read_text())
        alive = [(name, int(pid)) for name, pid in recorded.items() if _runs(int(pid), run_dir)]
    if alive:
        name, pid = alive[0]
        raise PreflightError(
            f"the run in {run_dir} is still running ({name}, pid {pid}): stop it first (Ctrl-C where it runs, "
            f"or kill -INT {pid}), then resume"
        )
    try:
        latest = ck.latest_checkpoint(run_dir / "checkpoints")
    except ValueError as err:
        raise PreflightError(f"{err}: point {run_dir / 'checkpoints' / ck.LATEST} at a whole checkpoint") from None
    if latest is None:
        return
    manifest = json.loads((latest / ck.MANIFEST).read_text())["files"]
    for rel, meta in manifest.items():
        f = latest / rel
        if not f.is_file() or f.stat().st_size != meta["bytes"]:
            raise PreflightError(
                f"checkpoint {latest} is damaged ({rel} is missing or of the wrong size): point "
                f"{run_dir / 'checkpoints' / ck.LATEST} at an older checkpoint"
            )
    step = ck.read_run_state(latest)["step"]
    if step >= cfg.run.steps:
        raise PreflightError(
            f"run.steps = {cfg.run.steps}: the run already trained {step} steps ({latest.name}); to train "
            f"longer, resume with --set run.steps=N for some N > {step}"
        )
