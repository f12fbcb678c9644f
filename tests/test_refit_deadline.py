"""A refit that cannot succeed stops the trainer after `refit.timeout_s` with one line: cause and fix.

The engines are told to reach the trainer's TCPStore at 192.0.2.1 (TEST-NET-1, routed nowhere), as a
multi-node run with the wrong `refit.host` would: every refit fails, and instead of retrying forever
the trainer (torchrun, with a real engine process) exits with code 2 and one `error:` line.
"""

import os
import signal
import time

import pytest

from tests.test_actor_refit import _engine, _registered, _until
from tests.test_actor_support import make_run, torchrun


@pytest.mark.slow  # a trainer and an engine start: ~40 s on two loaded cores
def test_a_refit_that_cannot_succeed_stops_the_run_with_its_cause(tmp_path, tiny_model_dir) -> None:
    sets = ["refit.host='192.0.2.1'", "refit.backend='gloo'", "refit.timeout_s=4", "run.steps=1", "engines.threads=1"]
    _, run = make_run(tmp_path, "dead", tiny_model_dir, sets)
    engine = _engine(run.path)
    try:
        _until(lambda: _registered(run.path, engine.pid), what="the engine to register")
        t0 = time.monotonic()
        code, log = torchrun(run.path, 1, timeout=240)
        took = time.monotonic() - t0
    finally:
        os.killpg(engine.pid, signal.SIGKILL)
        engine.wait(timeout=60)
    errors = [line for line in log.splitlines() if line.startswith("error:")]
    assert code != 0 and len(errors) == 1, log[-3000:]  # the rank exits 2; torchrun reports a failed child
    line = errors[0]
    assert "refits have failed for" in line and "refit.timeout_s = 4" in line
    assert "refit.host = '192.0.2.1': set it to an address" in line, line
    assert "192.0.2.1" in line and "init_weight_transfer_engine" in line, "the engines' own error is quoted"
    assert took < 200, "stopped near the deadline, not after many retries"
