"""The user's cache of built models (`models.cache`): a builtin model is built once per user and key, and
each run gets its own copy of the same bytes; a new library version or builder source is a new key."""

import filecmp
import os
from pathlib import Path

from molt_hpc.config import MoltConfig
from molt_hpc.models import cache
from molt_hpc.models.resolve import resolve_model


def _counting_build(calls: list[Path]):
    def build(out: Path) -> None:
        calls.append(out)
        (out / "config.json").write_text('{"deterministic": true}')

    return build


def test_a_second_run_copies_the_users_build(tmp_path, monkeypatch):
    monkeypatch.setenv("MOLT_HPC_CACHE", str(tmp_path / "user"))
    calls: list[Path] = []
    first = cache.build_once(tmp_path / "run1", "m", {"a": 1}, _counting_build(calls))
    second = cache.build_once(tmp_path / "run2", "m", {"a": 1}, _counting_build(calls))
    assert len(calls) == 1 and first != second
    assert (first / "config.json").read_text() == (second / "config.json").read_text()
    assert os.stat(first / "config.json").st_ino != os.stat(second / "config.json").st_ino  # a copy of its own
    assert (tmp_path / "user").stat().st_mode & 0o777 == 0o700
    cache.build_once(tmp_path / "run3", "m", {"a": 2}, _counting_build(calls))  # another config: another key
    monkeypatch.setattr(cache, "stamp", lambda: "other-versions")
    cache.build_once(tmp_path / "run4", "m", {"a": 1}, _counting_build(calls))  # other libraries: built again
    assert len(calls) == 3


def test_an_empty_setting_turns_the_users_cache_off(tmp_path, monkeypatch):
    monkeypatch.setenv("MOLT_HPC_CACHE", "")
    calls: list[Path] = []
    for run in ("run1", "run2"):
        cache.build_once(tmp_path / run, "m", {"a": 1}, _counting_build(calls))
    assert len(calls) == 2


def test_the_tiny_model_from_the_cache_is_the_built_one(tmp_path, monkeypatch):
    model = MoltConfig().model
    monkeypatch.setenv("MOLT_HPC_CACHE", "")
    built = resolve_model(model, tmp_path / "plain")
    monkeypatch.setenv("MOLT_HPC_CACHE", str(tmp_path / "user"))
    resolve_model(model, tmp_path / "warm")  # fills the user's cache
    copied = resolve_model(model, tmp_path / "copied")
    names = sorted(p.name for p in built.iterdir())
    assert names == sorted(p.name for p in copied.iterdir())
    match, mismatch, errors = filecmp.cmpfiles(built, copied, names, shallow=False)
    assert not mismatch and not errors and match
