"""Backpressure: a producer process blocks while `capacity` groups are pending and resumes as the
consumer takes them; claims held until a checkpoint do not count; a stuck consumer gives a clear error."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from molt_hpc.buffer import ReplayBuffer, acked_ids
from molt_hpc.buffer.spool import count
from molt_hpc.config.infra import BufferConfig
from tests.conftest import ROOT
from tests.test_buffer import make_group

PRODUCER = """
import json, sys
from molt_hpc.buffer import ReplayBuffer
from molt_hpc.config.infra import BufferConfig
from tests.test_buffer import make_group
root, n, capacity = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
buf = ReplayBuffer(root, BufferConfig(capacity=capacity, poll_interval_s=0.01), producer_id="rollout")
for k in range(n):
    buf.put(make_group(f"g{k}"))
print(json.dumps(buf.stats()))
"""


def wait_for(predicate, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_producer_blocks_at_capacity_and_resumes_when_the_consumer_takes(tmp_path: Path) -> None:
    k, hold = 3, 0.5
    cfg = BufferConfig(capacity=k, poll_interval_s=0.01)
    proc = subprocess.Popen(
        [sys.executable, "-c", PRODUCER, str(tmp_path), str(2 * k), str(k)], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    try:
        pending, marks = tmp_path / "pending", tmp_path / "producers" / "rollout"
        wait_for(lambda: count(pending) == k, f"{k} pending groups")
        time.sleep(hold)
        assert count(pending) == k and count(marks) == k and proc.poll() is None  # blocked, not done

        cons = ReplayBuffer(tmp_path, cfg, consumer_id="trainer")
        assert [g.group_id for g in cons.get(1, timeout=0)] == ["g0"]
        wait_for(lambda: count(marks) == k + 1 and count(pending) == k, "the producer to resume")
        time.sleep(0.2)
        assert count(marks) == k + 1 and count(pending) == k and proc.poll() is None  # one put, blocked again
        cons.ack(["g0"])

        taken = [g.group_id for g in cons.get(2 * k - 1, timeout=20)]  # held, not acked: claims > capacity
        assert taken == [f"g{i}" for i in range(1, 2 * k)]
        out, _ = proc.communicate(timeout=20)
        assert proc.returncode == 0 and count(pending) == 0
    finally:
        proc.kill()
    stats = json.loads(out)
    assert stats["buffer_puts"] == 2 * k and stats["buffer_put_blocked_s"] >= hold
    cons.ack(taken)
    assert sorted(acked_ids(tmp_path)) == sorted(f"g{i}" for i in range(2 * k))


def test_put_times_out_with_a_clear_error_and_reports_the_wait(tmp_path: Path) -> None:
    buf = ReplayBuffer(tmp_path, BufferConfig(capacity=1, put_timeout_s=0.3), producer_id="rollout")
    buf.put(make_group("g0"))
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"1 pending groups \(buffer.capacity = 1\).*trainer.*put_timeout_s"):
        buf.put(make_group("g1"))
    took = time.monotonic() - start
    assert took >= 0.3
    assert 0.3 <= buf.stats()["buffer_last_put_blocked_s"] <= took and not buf.was_put("g1")
