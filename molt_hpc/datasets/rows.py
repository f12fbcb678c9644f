"""Reading a stage's data file (JSONL, Parquet or a `save_to_disk` directory, through `molt_hpc.readers`; bad
rows refused or counted by reason) and the order rows train in.

`StepOrder` draws `batch_size` rows per step, epoch after epoch, through `molt_hpc.data.epoch_order`
(the RL prompts' length-balanced order: sorted by length, cut into buckets, shuffled inside each from
the seed and the epoch, drawn cycling through the buckets). Its state is (epoch, position), which a
checkpoint saves, so a resumed run trains exactly the rows it would have.
"""

import hashlib
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from molt_hpc.data import epoch_order
from molt_hpc.datasets.chat_mask import RowProblem
from molt_hpc.log import get_logger
from molt_hpc.readers import exists, iter_rows, kind

T = TypeVar("T")


def read_rows(
    path: str | Path, parse: Callable[[dict[str, Any], str], T], on_bad_row: str, limit: int | None = None
) -> tuple[list[T], Counter]:
    """`parse(row, row_id)` over every line of `path` (up to `limit` good rows); bad rows raise a
    `ValueError` naming file and line (`on_bad_row = "error"`) or are counted by reason (`"skip"`)."""
    path = Path(path)
    if not exists(path):
        raise ValueError(f"data file {path} not found (paths are relative to the working directory)")
    unit = "line" if kind(path) == "jsonl" else "row"
    out: list[T] = []
    bad: Counter = Counter()
    for number, row, problem in iter_rows(path):
        if limit is not None and len(out) >= limit:
            break
        try:
            if problem is not None:
                raise RowProblem(problem)
            if not isinstance(row, dict):
                raise RowProblem(f"a row must be a JSON object, got {type(row).__name__}")
            out.append(parse(row, str(row["id"]) if "id" in row else f"{path.name}:{number}"))
        except RowProblem as err:
            if on_bad_row == "error":
                raise ValueError(f'{path}, {unit} {number}: {err}; fix the row or set on_bad_row = "skip"') from None
            bad[str(err).split(" (")[0]] += 1
    if bad:
        get_logger().warning("%s: skipped %d bad rows: %s", path, sum(bad.values()), dict(bad))
    if not out:
        raise ValueError(f"{path}: no usable rows" + (f" (bad rows: {dict(bad)})" if bad else ""))
    return out, bad


def fingerprint(ids: list[str]) -> str:
    """Identifies a row set, so an order is never restored onto a different file."""
    return hashlib.sha256("\n".join(ids).encode()).hexdigest()[:16]


class StepOrder:
    """Which rows each step trains: a deterministic, resumable walk over the rows, epoch after epoch."""

    def __init__(self, lengths: list[int], buckets: int, seed: int, key: str):
        self.lengths, self.buckets, self.seed, self.key = lengths, buckets, seed, key
        self.epoch, self.position = 0, 0
        self._order: tuple[int, list[int]] | None = None

    def _epoch(self, epoch: int) -> list[int]:
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, epoch_order(self.lengths, self.buckets, self.seed, epoch))
        return self._order[1]

    def take(self, n: int) -> list[int]:
        """The next `n` row indices (crossing into the next epoch when one ends)."""
        out = []
        while len(out) < n:
            if self.position >= len(self.lengths):
                self.epoch, self.position = self.epoch + 1, 0
            order = self._epoch(self.epoch)
            part = order[self.position : self.position + n - len(out)]
            out += part
            self.position += len(part)
        return out

    def state(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "dataset": self.key}

    def restore(self, state: dict[str, Any]) -> None:
        if state.get("dataset") != self.key or state.get("seed") != self.seed:
            raise ValueError(
                "the checkpoint's data position belongs to another data file or seed: keep the stage's data "
                "and run.seed unchanged when resuming, or start a new run"
            )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
