"""The one row reader of every stage: the files users already have, and dotted keys into their rows.

`iter_rows(path)` yields `(where, row, problem)` for each row of

- a JSONL file (`where` is the line; a line that is not JSON gives its `problem` instead of a row);
- a Parquet file (`where` is the row number; needs pyarrow: `pip install pyarrow`);
- a `datasets.save_to_disk` directory of one split (its Arrow files, in the order `state.json` lists them, read
  with pyarrow; a `DatasetDict` directory names its splits, one of which `data.path` must name).

`row_value(row, "reward_model.ground_truth")` reads nested keys (the verl layout: `prompt` as chat messages, the
label under `reward_model.ground_truth`); a key present as written wins over its dotted reading.
"""

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

MISSING = object()
PYARROW = "pip install pyarrow"


def row_value(row: dict[str, Any], key: str) -> Any:
    """`row[key]`, following dots into nested objects; `MISSING` when absent."""
    if key in row:
        return row[key]
    value: Any = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return MISSING
        value = value[part]
    return value


def kind(path: str | Path) -> str:
    """`jsonl`, `parquet` or `arrow_dir` (a `save_to_disk` directory)."""
    p = Path(path)
    if p.is_dir():
        return "arrow_dir"
    return "parquet" if p.suffix == ".parquet" else "jsonl"


def exists(path: str | Path) -> bool:
    p = Path(path)
    return p.is_file() or (p.is_dir() and ((p / "state.json").is_file() or (p / "dataset_dict.json").is_file()))


def iter_rows(path: str | Path) -> Iterator[tuple[int, Any, str | None]]:
    """(line or row number from 1, the row or None, what is wrong or None) for every row of `path`."""
    readers = {"jsonl": _jsonl, "parquet": _parquet, "arrow_dir": _arrow_dir}
    yield from readers[kind(path)](Path(path))


def _jsonl(path: Path) -> Iterator[tuple[int, Any, str | None]]:
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield line_no, json.loads(line), None
            except json.JSONDecodeError as err:
                yield line_no, None, f"invalid JSON ({err.msg})"


def _pyarrow():
    try:
        import pyarrow
        import pyarrow.ipc
        import pyarrow.parquet
    except ImportError:
        raise ValueError(f"reading Parquet and Arrow files needs pyarrow: {PYARROW}") from None
    return pyarrow


def _parquet(path: Path) -> Iterator[tuple[int, Any, str | None]]:
    pa = _pyarrow()
    n = 0
    for batch in pa.parquet.ParquetFile(path).iter_batches(batch_size=1024):
        for row in batch.to_pylist():
            n += 1
            yield n, row, None


def _arrow_dir(path: Path) -> Iterator[tuple[int, Any, str | None]]:
    if (path / "dataset_dict.json").is_file():
        splits = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
        raise ValueError(f"{path} holds the splits {splits} (a DatasetDict): name one, e.g. {path / splits[0]}")
    pa = _pyarrow()
    files = [f["filename"] for f in json.loads((path / "state.json").read_text())["_data_files"]]
    n = 0
    for name in files:
        with pa.memory_map(str(path / name)) as source:
            for batch in pa.ipc.open_stream(source):
                for row in batch.to_pylist():
                    n += 1
                    yield n, row, None
