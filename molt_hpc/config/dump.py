"""Writing a config back out as TOML (the resolved config of a run), optionally with field docs.

TOML has no null: a field left unset is omitted, which is faithful because every optional field
defaults to None (asserted here).
"""

import re
from typing import Any

from pydantic import BaseModel

BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def to_toml(cfg: BaseModel, *, docs: bool = False) -> str:
    """The whole config as TOML text; `docs=True` puts each field's description above it."""
    out: list[str] = []
    _emit(cfg, [], out, docs)
    return "\n".join(out).strip() + "\n"


def _emit(model: BaseModel, prefix: list[str], out: list[str], docs: bool) -> None:
    fields = type(model).model_fields
    scalars, tables = [], []
    for name, field in fields.items():
        value = getattr(model, name)
        (tables if isinstance(value, BaseModel) else scalars).append((name, field, value))
    if prefix and (scalars or not tables):
        out.append(f"\n[{'.'.join(prefix)}]")
    for name, field, value in scalars:
        if value is None:
            assert field.default is None, f"{'.'.join([*prefix, name])} is None but defaults to {field.default}"
            continue
        if docs and field.description:
            out.extend(f"# {line.strip()}" for line in field.description.splitlines())
        out.append(f"{name} = {_value(value)}")
    for name, _field, value in tables:
        _emit(value, [*prefix, name], out, docs)


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    if isinstance(value, BaseModel):  # a section inside a list (`tasks = [{ name = ... }]`): an inline table
        value = {k: v for k, v in value if v is not None}
    if isinstance(value, dict):
        items = (f"{k if BARE_KEY.fullmatch(k) else _value(k)} = {_value(v)}" for k, v in value.items())
        return "{ " + ", ".join(items) + " }" if value else "{}"
    raise TypeError(f"cannot write {type(value).__name__} to TOML")
