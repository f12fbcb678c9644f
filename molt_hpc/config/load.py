"""Loading a config: TOML file + dotted `--set` overrides → a validated `MoltConfig`.

Every way a config can be wrong ends in one `ConfigError` whose lines each name the key path,
what was wrong and what is allowed (`key: what is wrong (got value)`; a rule across keys names the
keys itself; a section's raw contents are never printed), so the CLI can print them and exit 2
without a traceback.
"""

import datetime
import difflib
import tomllib
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from molt_hpc.config.root import MoltConfig


class ConfigError(ValueError):
    """A config the user must fix; the message is meant to be printed as is."""


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> MoltConfig:
    """Read `path` (or the embedded defaults when None), apply `key.path=value` overrides, validate."""
    source = str(path) if path is not None else "the embedded defaults"
    if overrides:
        source += " with --set overrides"
    data = read_toml(path) if path is not None else {}
    for item in overrides:
        apply_override(data, item)
    return validate(data, source)


def read_toml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        hint = f"; configs shipped: {', '.join(sorted(x.name for x in Path('configs').glob('*.toml')))}"
        raise ConfigError(f"config file {p} not found" + (hint if Path("configs").is_dir() else ""))
    try:
        return tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{p}: invalid TOML: {err}") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{p}: cannot read: {err}") from None


def parse_value(text: str) -> Any:
    """A `--set` value as TOML (`0.01`, `true`, `[1, 2]`, `"x"`); anything else is a plain string."""
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text
    # `01:00:00` parses as a TOML time; every config field that looks like one is a string.
    return text if isinstance(value, datetime.date | datetime.time) else value


def apply_override(data: dict[str, Any], item: str) -> None:
    """Apply one `a.b.c=value` override to the nested dict `data` in place."""
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"--set {item!r}: write overrides as dotted.key=value, e.g. algorithm.kl_coef=0.01")
    node = data
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {item!r}: {'.'.join(parts[: i + 1])} is a value, not a section")
        node = child
    node[parts[-1]] = parse_value(raw.strip())


def validate(data: dict[str, Any], source: str) -> MoltConfig:
    try:
        return MoltConfig.model_validate(data)
    except ValidationError as err:
        lines = [f"config error ({source}): {describe(e)}" for e in err.errors()]
        raise ConfigError("\n".join(lines)) from None


def describe(error: dict[str, Any]) -> str:
    """One line for one pydantic error: the key path, what was wrong, what is allowed."""
    loc = [str(x) for x in error["loc"]]
    path = ".".join(loc)
    kind = error["type"]
    if kind == "extra_forbidden":
        allowed = _field_names(loc[:-1])
        near = difflib.get_close_matches(loc[-1], allowed, n=1, cutoff=0.6)
        hint = f"did you mean {'.'.join([*loc[:-1], near[0]])!r}?" if near else f"allowed: {', '.join(allowed)}"
        return f"unknown key {path!r} ({hint})"
    if kind == "missing":
        return f"{path}: required key is missing; add it"
    message = error["msg"].removeprefix("Value error, ")
    if kind == "model_type":  # a value where a section belongs
        message = f"is a section: write it as a [{path}] table of keys (see `molt-hpc config --docs`)"
    if not loc or message.startswith(path):  # a rule across keys names them itself
        return message
    value = error.get("input")
    if isinstance(value, dict) or (isinstance(value, str) and repr(value) in message):  # no raw sections, nor twice
        return f"{path}: {message}"
    return f"{path}: {message} (got {value!r})"


def _field_names(loc: list[str]) -> list[str]:
    """Field names of the section at `loc`, walking the model classes (unions: the model member)."""
    model: type[BaseModel] = MoltConfig
    for name in loc:
        field = model.model_fields.get(name)
        if field is None:
            return []
        model = _model_of(field.annotation)
        if model is None:
            return []
    return sorted(model.model_fields)


def _model_of(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _model_of(arg)
        if found is not None:
            return found
    return None
