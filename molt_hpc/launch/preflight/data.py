"""Pre-flight of a prompt file (JSONL, Parquet or a `save_to_disk` directory): its first rows parse with the
configured keys, render through the chat template (with a vision-language model, their images load and their
placeholders expand), and fit `data.max_prompt_tokens` — the checks `PromptDataset.load` makes at the run's
start, on a sample, with counts instead of the first failure alone.
"""

from collections import Counter
from pathlib import Path
from typing import Any

from molt_hpc.config.model import DataConfig
from molt_hpc.data import render_prompt_images, row_problem, text_prompt_ids
from molt_hpc.readers import iter_rows, kind, row_value

SAMPLE_ROWS = 256
"""Rows checked per file: enough to catch a wrong key or template, few enough to stay well under a second."""


def _fail(message: str) -> None:
    from molt_hpc.launch.preflight.files import PreflightError

    raise PreflightError(message)


def _render(cfg: DataConfig, tokenizer: Any, row: dict, where: str, vision: Any, path: str) -> int | str:
    """Prompt tokens of one row, or what is wrong with its images; a template that cannot render it stops
    the pre-flight."""
    if vision is not None:
        try:
            ids, _ = render_prompt_images(
                tokenizer, vision, row_value(row, cfg.prompt_key), row.get(cfg.image_key) or [],
                base_dir=Path(path).parent, system_prompt=cfg.system_prompt, tools=row.get("tools"),
            )  # fmt: skip
        except ValueError as err:  # an image that does not load, a placeholder count that does not match
            return f"bad images ({err})"
        return len(ids)
    try:
        ids = text_prompt_ids(tokenizer, row, cfg)
    except Exception as err:  # jinja and tokenizer errors come in many types; the message is what counts
        text = " ".join(str(err).split()) or type(err).__name__
        _fail(f"data.apply_chat_template = {cfg.apply_chat_template}: the prompt of {where} does not render: {text}")
    return len(ids)


def check_rows(
    cfg: DataConfig, tokenizer: Any, path: str, key: str, limit: int = SAMPLE_ROWS, vision: Any = None
) -> list[str]:
    """Check the first `limit` rows of `path` (the file behind config key `key`); returns warnings for what
    `data.on_bad_row = "skip"` will skip, raises `PreflightError` for what stops the run. `vision`: the
    model takes images (True before its `Vision` is had, then the `Vision` to expand them with)."""
    from molt_hpc.launch.preflight.files import PreflightError

    skip = cfg.on_bad_row == "skip"
    seen, usable, bad = 0, 0, Counter()
    too_long: list[tuple[int, int]] = []  # (tokens, line) of prompts over the limit
    unit = "line" if kind(path) == "jsonl" else "row"
    try:
        for line_no, row, problem in iter_rows(path):
            if seen >= limit:
                break
            seen += 1
            where = f"{path}, {unit} {line_no}"
            if problem is None:
                problem = row_problem(row, cfg, bool(vision))
            tokens = 0
            if problem is None and tokenizer is not None:
                tokens = _render(cfg, tokenizer, row, where, None if vision is True else vision, path)
                if isinstance(tokens, str):
                    problem = tokens
            if problem is None and tokenizer is not None and tokens > cfg.max_prompt_tokens:
                too_long.append((tokens, line_no))
                continue
            if problem is None:
                usable += 1
            elif skip:
                bad[problem] += 1
            else:
                _fail(f'{key} = {path!r}: {unit} {line_no}: {problem}; fix the row or set data.on_bad_row = "skip"')
    except UnicodeDecodeError as err:
        _fail(f"{key} = {path!r} is not UTF-8 text ({err.reason}); give a JSONL file")
    except PreflightError:
        raise
    except Exception as err:  # pyarrow missing, a DatasetDict directory, pyarrow's errors of many types
        _fail(f"{key} = {path!r} cannot be read as {kind(path)}: {' '.join(str(err).split())}")
    if seen == 0:
        _fail(f"{key} = {path!r} has no rows; give a JSONL file with one prompt object per line")
    sample = f"the first {seen} rows of {path}" if seen >= limit else f"the {seen} rows of {path}"
    if too_long:
        longest, line_no = max(too_long, key=lambda t: (t[0], -t[1]))  # the first of the longest
        counted = f"{len(too_long)} of {sample} have prompts over data.max_prompt_tokens = {cfg.max_prompt_tokens}"
        detail = f"(the longest {longest} tokens, line {line_no})"
        if not skip:
            _fail(f'{counted} {detail}; raise data.max_prompt_tokens or set data.on_bad_row = "skip"')
        bad[f"prompt over {cfg.max_prompt_tokens} tokens"] += len(too_long)
    if usable == 0:
        reasons = "; ".join(f"{n} × {why}" for why, n in bad.most_common(3))
        _fail(f"{key} = {path!r}: no usable row in {sample} ({reasons}); check data.prompt_key and data.label_key")
    if not bad:
        return []
    reasons = ", ".join(f"{n} × {why}" for why, n in bad.most_common())
    return [f'{key}: {sum(bad.values())} of {sample} will be skipped (data.on_bad_row = "skip"): {reasons}']
