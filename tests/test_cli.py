"""The CLI stays light: importing it, or the launchers a config error passes through before it is
reported, pulls no torch or transformers (a bad config fails in well under a second)."""

import subprocess
import sys

import pytest

from tests.conftest import molt

LAUNCHERS = ["molt_hpc.launch.local", "molt_hpc.launch.slurm", "molt_hpc.launch.preflight"]
"""The buffer's codec brings numpy to the launchers (tens of milliseconds); torch would bring seconds."""


@pytest.mark.parametrize(
    ("module", "heavy"),
    [("molt_hpc.cli", "torch transformers numpy"), *((m, "torch transformers") for m in LAUNCHERS)],
)
def test_import_pulls_no_heavy_modules(module: str, heavy: str) -> None:
    code = f"import sys, {module}; print(','.join(m for m in {heavy.split()} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == ""


def test_help_lists_commands() -> None:
    result = molt("--help")
    assert result.returncode == 0
    for command in ("config", "model"):
        assert command in result.stdout
