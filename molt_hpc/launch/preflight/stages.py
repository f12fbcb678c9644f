"""Pre-flight of the stages beyond RL (`molt-hpc sft`, `molt-hpc rm train`) and of a reward model in RL.

A stage reads its own files (`sft.data`, `rm.eval_data`, ...) instead of the prompts and the agent,
so those are what it checks: the files exist, the model's chat template gives the reply markers, and
the first rows parse, render and fit `max_tokens` — the checks the stage's dataset makes at the run's
start, on a sample. A `[reward_model]` of an RL run names a reward model that exists (a run
directory: its latest checkpoint's `reward`), is a one-label sequence classifier, reads the policy's
token ids (the same tokenizer) and has the statistics its normalisation needs.
"""

from pathlib import Path
from typing import Any

from molt_hpc.config import MoltConfig

SAMPLE_ROWS = 256
"""Good rows checked per file: enough to catch a wrong key or template, few enough to stay fast."""

WHAT = {"sft": "JSONL file of chat demonstrations", "rm": "JSONL file of preference pairs"}
COMMANDS = {"sft": "molt-hpc sft", "rm": "molt-hpc rm train"}


def stage_files(cfg: MoltConfig) -> list[tuple[str, str]]:
    """(config key, path) of every file the run's stage reads; none for RL."""
    stage = cfg.run.stage
    sec = getattr(cfg, stage, None) if stage != "rl" else None
    if sec is None:
        return []
    files = [(f"{stage}.data", sec.data)]
    if sec.eval_data:
        files.append((f"{stage}.eval_data", sec.eval_data))
    return files


def absolute_stage_paths(data: dict[str, Any], cfg: MoltConfig, absolute) -> None:
    """Make the stage sections' files, `reward_model.path` and `distill.teacher` absolute in the dumped `data`."""
    for name in ("sft", "rm"):
        sec = getattr(cfg, name)
        if sec is None:
            continue
        data[name]["data"] = absolute(sec.data)
        if sec.eval_data:
            data[name]["eval_data"] = absolute(sec.eval_data)
    if cfg.reward_model is not None:
        data["reward_model"]["path"] = absolute(cfg.reward_model.path)
    if cfg.distill is not None and not cfg.distill.teacher.startswith("builtin:"):
        data["distill"]["teacher"] = absolute(cfg.distill.teacher)


def check_stage_files(resolved: MoltConfig, original: MoltConfig, cwd: Path) -> None:
    """Every file of the stage exists (no tokenizer needed: this runs before the model is loaded)."""
    from molt_hpc.launch.preflight.files import check_file

    given = dict(stage_files(original))
    for key, path in stage_files(resolved):
        check_file(key, given[key], path, cwd, f"give an existing {WHAT[resolved.run.stage]}")


def check_stage_rows(cfg: MoltConfig, tokenizer: Any, vision: Any = None) -> None:
    """The first rows of each stage file load as the stage will load them (the reply mask included)."""
    from molt_hpc.datasets import PreferenceDataset, ReplyMarkers, SftDataset
    from molt_hpc.launch.preflight.files import PreflightError

    stage = cfg.run.stage
    if stage != "rl" and vision is not None:
        raise PreflightError(
            f"model.path = {cfg.model.path!r} is a vision-language model, and `{COMMANDS[stage]}` trains on text "
            "rows only (no images reach its trainer): train this stage on a text model"
        )
    if tokenizer is None or stage == "rl":  # builtin:smollm2: its tokenizer comes with the conversion at start
        return
    try:
        markers = ReplyMarkers.probe(tokenizer)
    except ValueError as err:
        raise PreflightError(f"model.path = {cfg.model.path!r}: {err}") from None
    sec = getattr(cfg, stage)
    dataset = SftDataset if stage == "sft" else PreferenceDataset
    for key, path in stage_files(cfg):
        try:
            dataset.load(path, sec, tokenizer, markers, limit=SAMPLE_ROWS)
        except ValueError as err:
            text = str(err).replace("on_bad_row", f"{stage}.on_bad_row").replace("max_tokens", f"{stage}.max_tokens")
            raise PreflightError(f"{key}: {text}") from None


def check_reward_model_section(cfg: MoltConfig, original: MoltConfig, tokenizer: Any) -> None:
    """The `[reward_model]` of an RL run can score its rollouts."""
    from molt_hpc.launch.preflight.files import PreflightError
    from molt_hpc.models.reward import check_reward_model, resolve_reward_model

    rm = cfg.reward_model
    if rm is None or cfg.run.stage != "rl":
        return
    where = f"reward_model.path = {original.reward_model.path!r}"  # type: ignore[union-attr]
    try:
        resolve_reward_model(rm)
        if tokenizer is not None:
            check_reward_model(rm, tokenizer)
    except ValueError as err:
        raise PreflightError(f"{where}: {err}") from None
