"""torchrun as the actor pool runs it (`python -m molt_hpc.launch.torchrun`): a stop reaches the ranks,
they finish their step and exit 0, and torchrun ends with them, quietly, whichever way the SIGTERM came."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

RANK = """
import os, signal, sys, time
from pathlib import Path
out = Path(sys.argv[1])
stop = []
signal.signal(signal.SIGTERM, lambda s, f: stop.append(s))
(out / f"up-{os.environ['RANK']}").touch()
while not stop:
    time.sleep(0.05)
time.sleep(0.3)  # the step boundary and the checkpoint
(out / f"stopped-{os.environ['RANK']}").write_text(str(len(stop)))
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # as jobs/actor.py does once it is done
"""


def start(tmp_path: Path) -> subprocess.Popen:
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    cmd = [sys.executable, "-m", "molt_hpc.launch.torchrun", "--standalone", "--nproc-per-node", "2",
           str(script), str(tmp_path)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"up-{r}").exists() for r in (0, 1)):
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, "the ranks did not start"
        time.sleep(0.1)
    return proc


@pytest.mark.parametrize("to", ["group", "torchrun"])
def test_a_stop_ends_torchrun_with_its_ranks_and_no_traceback(tmp_path: Path, to: str) -> None:
    """`group`: every process gets SIGTERM at once (Slurm's step signal, local mode's stop);
    `torchrun`: only torchrun gets it and passes it on to the ranks."""
    proc = start(tmp_path)
    if to == "group":
        os.killpg(proc.pid, signal.SIGTERM)
    else:
        proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert "Traceback" not in out and "SignalException" not in out, out
    for rank in (0, 1):
        assert int((tmp_path / f"stopped-{rank}").read_text()) >= 1  # each rank finished its step
