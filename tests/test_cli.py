"""The CLI stays light: importing it pulls no torch, transformers or pydantic-heavy modules."""

import subprocess
import sys

from tests.conftest import molt


def test_cli_import_pulls_no_heavy_modules() -> None:
    code = (
        "import sys, molt_hpc.cli; print(','.join(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == ""


def test_help_lists_commands() -> None:
    result = molt("--help")
    assert result.returncode == 0
    for command in ("config", "model"):
        assert command in result.stdout
