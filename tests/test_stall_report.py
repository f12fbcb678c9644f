"""The stall report: a process frozen by code that holds the GIL still says where it is stuck."""

import subprocess
import sys
import textwrap

from tests.conftest import ROOT

FROZEN = textwrap.dedent(
    """
    import re
    from molt_hpc.log import StallReport

    def runaway():  # nested repetition on a run of letters that fails at the end: exponential, GIL held
        return re.match(r"(?:[a-z]+\\.?)+$", "a" * 25 + "1")

    report = StallReport(0.5)
    report.beat()
    runaway()
    report.stop()
    print("done")
    """
)
LIVELY = textwrap.dedent(
    """
    import time
    from molt_hpc.log import StallReport

    report = StallReport(0.5)
    for _ in range(20):  # a loop that keeps beating is never reported
        report.beat()
        time.sleep(0.05)
    report.stop()
    time.sleep(0.8)  # stopped: nothing fires afterwards either
    print("done")
    """
)


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_a_frozen_process_reports_where_it_is_stuck() -> None:
    out = _run(FROZEN)
    assert out.returncode == 0 and out.stdout.strip() == "done", out.stderr
    assert "Timeout (0:00:00.500000)!" in out.stderr
    assert "in runaway" in out.stderr  # the frame that holds the GIL


def test_a_beating_process_is_not_reported() -> None:
    out = _run(LIVELY)
    assert out.returncode == 0 and out.stdout.strip() == "done"
    assert "Timeout" not in out.stderr, out.stderr
