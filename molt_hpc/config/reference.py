"""The configuration reference as Markdown, generated from the config tree's field docstrings.

`molt-hpc config --docs --format markdown` prints it; `docs/config.md` is its output, checked for
staleness by the test suite. It walks the classes, not a loaded config, so optional sections
(`[sft]`, `[reward_model]`, ...) and fields that default to None are listed too.
"""

import types
import typing
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

HEADER = """# Configuration reference

Generated from the docstrings of the config tree (`molt_hpc/config/`) by
`molt-hpc config --docs --format markdown`; a test fails when this file is stale. A TOML file mirrors
the tree (`[section]`, `[section.sub]`); `--set dotted.key=value` overrides any field. Unknown keys,
wrong types and out-of-range values are refused with one line naming the key (exit code 2).
"""


def reference_markdown(root: type[BaseModel]) -> str:
    """Every section of `root`, depth first, as a Markdown table of its fields."""
    out = [HEADER]
    _section(root, [], out)
    return "\n".join(out).rstrip() + "\n"


def _section(model: type[BaseModel], prefix: list[str], out: list[str]) -> None:
    rows, subs = [], []
    for name, field in model.model_fields.items():
        sub = section_class(field.annotation)
        if sub is not None:
            subs.append((name, sub, field.description or ""))
        else:
            rows.append((name, field))
    if prefix:
        out.append(f"\n## `[{'.'.join(prefix)}]`\n")
        out.append(_cell(model.__doc__ or "") + "\n")
    if rows:
        out.append("| key | type | default | description |")
        out.append("|---|---|---|---|")
        out.extend(
            f"| `{n}` | {_cell(_type(f.annotation))} | {_default(f)} | {_cell(f.description or '')} |" for n, f in rows
        )
    for name, sub, _doc in subs:
        _section(sub, [*prefix, name], out)


def section_class(annotation: Any) -> type[BaseModel] | None:
    """The section class a field holds (`X` or `X | None`), or None for a plain value."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        models = [a for a in typing.get_args(annotation) if isinstance(a, type) and issubclass(a, BaseModel)]
        if len(models) == 1:
            return models[0]
    return None


def _type(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return " | ".join(repr(a).replace("'", '"') for a in typing.get_args(annotation))
    if origin is typing.Annotated:
        return _type(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type(a) for a in typing.get_args(annotation))
    if origin is not None:
        args = ", ".join(_type(a) for a in typing.get_args(annotation))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    if annotation is type(None):
        return "None"
    return getattr(annotation, "__name__", str(annotation))


def _default(field: Any) -> str:
    if field.default is PydanticUndefined:
        return "(required)" if field.default_factory is None else f"`{_cell(repr(field.default_factory()))}`"
    return f"`{_cell(repr(field.default))}`"


def _cell(text: str) -> str:
    """One table cell: a single line, pipes escaped."""
    return " ".join(line.strip() for line in text.splitlines()).replace("|", "\\|")
