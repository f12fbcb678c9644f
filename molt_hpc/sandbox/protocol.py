"""The sandbox's HTTP bodies, typed: `POST /run` takes a `RunRequest` and answers a `RunResult`.

`GET /health` answers `{"status": "ok", "isolation": ..., "workers": N, "live_workers": N, "queued": N,
"running": N, "executions": N, "users": [slot user ids]}`. A full queue answers 429 (`Retry-After`);
every route needs the run's token.
"""

import re

from pydantic import BaseModel, ConfigDict, Field, field_validator

FILE_NAME = re.compile(r"^[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*$")
MAX_BODY_BYTES = 16 << 20
"""Largest request body (code, stdin and files together)."""


class RunRequest(BaseModel):
    """One execution: Python source, its stdin, files placed in its working directory, a wall limit."""

    model_config = ConfigDict(extra="forbid")

    code: str
    """Python source, run as a file (`python3 -I main.py`)."""
    stdin: str = ""
    """Text fed to the program's standard input."""
    files: dict[str, str] = Field(default_factory=dict)
    """Relative path -> text, written into the working directory before the code runs."""
    timeout: float | None = Field(None, gt=0)
    """Wall-clock limit in seconds (at most `sandbox.timeout_s`, its default)."""

    @field_validator("files")
    @classmethod
    def _names(cls, files: dict[str, str]) -> dict[str, str]:
        for name in files:
            if not FILE_NAME.match(name) or any(part in (".", "..") for part in name.split("/")):
                raise ValueError(f"file name {name!r}: use a relative path of letters, digits, '_', '-', '.', '/'")
        return files


class RunResult(BaseModel):
    """What one execution did."""

    model_config = ConfigDict(extra="forbid")

    stdout: str
    """Standard output (at most `sandbox.max_output_bytes`, decoded with replacement)."""
    stderr: str
    """Standard error, likewise capped."""
    exit_code: int
    """The program's exit status (negative: killed by that signal)."""
    timed_out: bool
    """The wall-clock limit ended it."""
    killed_reason: str | None
    """`timeout`, `output`, `cpu`, `memory` when a limit ended or failed it; None otherwise."""
    wall_s: float
    """Seconds from start to end of the program (queueing excluded)."""

    @property
    def ok(self) -> bool:
        """It exited 0 within every limit."""
        return self.exit_code == 0 and self.killed_reason is None
