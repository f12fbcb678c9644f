"""The pre-flight's one failure, `PreflightError`, and the check every configured file passes (it exists, it
is a file), said the way the user wrote the path."""

from pathlib import Path

from molt_hpc.config import ConfigError


class PreflightError(ConfigError):
    """The run cannot start as configured; the message names the key and the fix."""


def where_read(original: str, cwd: Path) -> str:
    """How a relative path was read, for a message about it."""
    rel = not Path(original).expanduser().is_absolute()
    return f" (relative paths are taken from the working directory, {cwd})" if rel else ""


def check_file(key: str, original: str, resolved: str, cwd: Path, fix: str) -> None:
    path = Path(resolved)
    if not path.exists():
        raise PreflightError(f"{key} = {original!r}: {path} does not exist{where_read(original, cwd)}; {fix}")
    if not path.is_file():
        raise PreflightError(f"{key} = {original!r}: {path} is not a file; {fix}")
