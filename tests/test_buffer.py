"""Replay buffer: the group file format, the claim/commit protocol, staleness, quarantine, leases, stats.

Everything runs on real files (a tmp directory, and /dev/shm for the shm backend); the crash and
concurrency tests with real processes are in test_buffer_faults.py and test_buffer_backpressure.py.
"""

import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from molt_hpc.buffer import ClaimLost, ReplayBuffer, acked_ids, find_spool, open_buffer, spool_counts
from molt_hpc.buffer.codec import decode_group, encode_group
from molt_hpc.buffer.spool import SpoolName, names
from molt_hpc.config.infra import BufferConfig
from molt_hpc.trajectory import Group, Trajectory
from tests.conftest import molt


def make_group(gid: str, version: int = 0, n: int = 2, length: int = 12) -> Group:
    """A small group whose log-probs are exact in float32 (multiples of 1/8)."""
    samples = []
    for i in range(n):
        tokens = [(7 * i + j) % 50 for j in range(length + i)]
        ranges = [(4, 7), (9, length + i)]
        n_act = sum(b - a for a, b in ranges)
        samples.append(
            Trajectory(
                tokens=tokens,
                prompt_len=4,
                action_ranges=ranges,
                action_logprobs=[-(j % 9) / 8 for j in range(n_act)],
                versions=[version + (j % 2) for j in range(n_act)],
                reward=0.25 * i,
                score=None if i else 1.5,
                finish_reason="length" if i else "stop",
                info={"turns": i + 1},
                group_id=gid,
                rollout_id=f"{gid}-{i}",
            )
        )
    return Group(gid, f"prompt-{gid}", samples, {"epoch": 0, "index": 3}, {"label": "42"})


@pytest.fixture(params=["fs", "shm"])
def run_dir(request, tmp_path):
    """A run directory for each backend; the shm spool is removed afterwards."""
    cfg = BufferConfig(backend=request.param)
    yield tmp_path, cfg
    shutil.rmtree(find_spool(tmp_path), ignore_errors=True)


def f32(values: list[float]) -> list[float]:
    return [float(np.float32(v)) for v in values]


trajectories = st.integers(0, 4).flatmap(
    lambda n_ranges: st.tuples(
        st.lists(st.integers(0, 2**31 - 1), min_size=2 * n_ranges + 1, max_size=40),
        st.floats(allow_nan=False, width=64),
        st.one_of(st.none(), st.lists(st.integers(0, 63), min_size=2, max_size=2)),
    )
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(trajectories, min_size=1, max_size=4), st.floats(-20, 0))
def test_codec_round_trip(specs, logprob) -> None:
    samples = []
    for tokens, reward, experts in specs:
        ranges = [(k, k + 1) for k in range(1, len(tokens), 2)]
        n_act = len(ranges)
        samples.append(
            Trajectory(
                tokens=tokens,
                prompt_len=1,
                action_ranges=ranges,
                action_logprobs=[logprob] * n_act,
                versions=list(range(n_act)),
                reward=reward,
                group_id="g",
                routed_experts=None if experts is None else [[experts]] * len(tokens),
            )
        )
    group = Group("g", "p", samples, {"epoch": 1, "index": 2}, {"k": [1, "a"]})
    back = decode_group(encode_group(group))
    for s in group.samples:  # the one lossy field: log-probs are stored as float32
        s.action_logprobs = f32(s.action_logprobs)
    assert back == group


def test_encode_rejects_token_ids_beyond_int32() -> None:
    group = make_group("g")
    group.samples[0].tokens[0] = 2**31
    with pytest.raises(ValueError, match="token ids"):
        encode_group(group)


def test_put_get_ack_round_trip_fifo(run_dir) -> None:
    path, cfg = run_dir
    prod = open_buffer(cfg, path, producer_id="rollout")
    cons = open_buffer(cfg, path, consumer_id="trainer")
    for k in range(5):
        assert prod.put(make_group(f"g{k}", version=k))
    got = cons.get(3, timeout=0)
    expected = [make_group(f"g{k}", version=k) for k in range(3)]
    for g in expected:
        for s in g.samples:
            s.action_logprobs = f32(s.action_logprobs)
    assert got == expected
    assert spool_counts(find_spool(path))["claimed_by"] == {"trainer": 3}
    cons.ack(["g1", "g0"])
    cons.ack(["g0"])  # idempotent
    assert acked_ids(find_spool(path)) == ["g0", "g1"]
    assert [g.group_id for g in cons.get(5, timeout=0)] == ["g3", "g4"]
    assert os.path.getsize(find_spool(path) / "acked" / names(find_spool(path) / "acked")[0]) == 0


def test_shm_backend_lives_in_dev_shm_and_stats_finds_it(tmp_path) -> None:
    cfg = BufferConfig(backend="shm")
    buf = open_buffer(cfg, tmp_path, producer_id="rollout")
    try:
        assert buf.root.parent == Path("/dev/shm") and tmp_path.name in buf.root.name
        assert oct(buf.root.stat().st_mode & 0o777) == "0o700"
        buf.put(make_group("a"))
        result = molt("buffer", "stats", str(tmp_path))
        assert result.returncode == 0, result.stderr
        assert result.stdout.split()[:4] == ["buffer", str(buf.root), "pending", "1"]
    finally:
        shutil.rmtree(buf.root)


def test_put_is_idempotent_across_producer_restarts(run_dir) -> None:
    path, cfg = run_dir
    assert open_buffer(cfg, path, producer_id="p").put(make_group("g0"))
    again = open_buffer(cfg, path, producer_id="p")
    assert again.was_put("g0") and not again.was_put("g1")
    assert not again.put(make_group("g0"))
    cons = open_buffer(cfg, path, consumer_id="c")
    cons.ack([g.group_id for g in cons.get(1, timeout=0)])
    assert not open_buffer(cfg, path, producer_id="p").put(make_group("g0"))  # acked: still known
    assert acked_ids(find_spool(path)) == ["g0"] and spool_counts(find_spool(path))["pending"] == 0


def test_claims_are_exclusive_and_return_on_consumer_restart(run_dir) -> None:
    path, cfg = run_dir
    prod = open_buffer(cfg, path, producer_id="p")
    for k in range(6):
        prod.put(make_group(f"g{k}"))
    a, b = open_buffer(cfg, path, consumer_id="a"), open_buffer(cfg, path, consumer_id="b")
    got_a = [g.group_id for g in a.get(4, timeout=0)]
    got_b = [g.group_id for g in b.get(4, timeout=0)]
    assert got_a == ["g0", "g1", "g2", "g3"] and got_b == ["g4", "g5"]
    a.ack(["g0"])
    del a  # consumer a dies holding g1..g3; its restart returns them, oldest first
    a2 = open_buffer(cfg, path, consumer_id="a")
    assert [g.group_id for g in a2.get(3, timeout=0)] == ["g1", "g2", "g3"]
    a2.ack(["g1", "g2", "g3"])
    b.ack(["g4", "g5"])
    assert sorted(acked_ids(find_spool(path))) == [f"g{k}" for k in range(6)]


def test_ack_commits_a_released_group_and_reports_lost_ones(run_dir) -> None:
    path, cfg = run_dir
    prod = open_buffer(cfg, path, producer_id="p")
    prod.put(make_group("g0"))
    prod.put(make_group("g1"))
    first = open_buffer(cfg, path, consumer_id="trainer")
    first.get(2, timeout=0)
    # the trainer checkpointed g0 and g1, then crashed before acking; on restart both wait in pending
    resumed = open_buffer(cfg, path, consumer_id="trainer")
    other = open_buffer(cfg, path, consumer_id="other")
    other.get(1, timeout=0)  # takes g0
    with pytest.raises(ClaimLost, match="lease_timeout_s"):
        resumed.ack(["g0", "g1", "never-put"])
    assert acked_ids(find_spool(path)) == ["g1"]


def test_stale_groups_are_moved_aside(run_dir) -> None:
    path, cfg = run_dir
    prod = open_buffer(cfg, path, producer_id="p")
    for version in (1, 3, 5, 6):  # min_version of make_group is `version`
        prod.put(make_group(f"v{version}", version=version))
    cons = open_buffer(cfg, path, consumer_id="c")
    got = cons.get(4, timeout=0, current_version=6, max_staleness=2)  # keeps 6 - v <= 2
    assert [g.group_id for g in got] == ["v5", "v6"]
    counts = spool_counts(find_spool(path))
    assert counts["stale"] == 2 and counts["pending"] == 0
    assert sorted(SpoolName.parse(n).group_id for n in names(find_spool(path) / "stale")) == ["v1", "v3"]
    assert cons.stats()["buffer_stale"] == 2


def test_bad_files_are_quarantined_without_stopping_the_consumer(run_dir) -> None:
    path, cfg = run_dir
    prod = open_buffer(cfg, path, producer_id="p")
    prod.put(make_group("good0"))
    pending = find_spool(path) / "pending"
    good = names(pending)[0]
    data = encode_group(make_group("cut"))
    bad_names = {
        "notes.txt": b"hello",  # foreign name
        good.replace("good0", "cut"): data[: len(data) // 2],  # truncated file under a valid name
        good.replace("good0", "liar"): data,  # the content's group id disagrees with the name
    }
    for name, payload in bad_names.items():
        (pending / name).write_bytes(payload)
    prod.put(make_group("good1"))
    cons = open_buffer(cfg, path, consumer_id="c")
    assert [g.group_id for g in cons.get(3, timeout=0.2)] == ["good0", "good1"]
    quarantine = find_spool(path) / "quarantine"
    assert sorted(names(quarantine)) == sorted(bad_names)
    reasons = {p.name.removesuffix(".txt"): p.read_text() for p in (quarantine / ".reasons").iterdir()}
    assert "foreign" in reasons["notes.txt"] and "name says otherwise" in reasons[good.replace("good0", "liar")]
    assert spool_counts(find_spool(path))["quarantined"] == 3


def test_expired_lease_returns_claims_but_heartbeat_keeps_them(tmp_path) -> None:
    cfg = BufferConfig(lease_timeout_s=0.8)
    prod = ReplayBuffer(tmp_path, cfg, producer_id="p")
    for k in range(4):
        prod.put(make_group(f"g{k}"))
    live, dead = ReplayBuffer(tmp_path, cfg, "live"), ReplayBuffer(tmp_path, cfg, "dead")
    live.get(2, timeout=0)
    dead.get(2, timeout=0)
    other = ReplayBuffer(tmp_path, cfg, "other")
    start = time.monotonic()
    taken = []
    while len(taken) < 2 and time.monotonic() - start < 5:
        live.heartbeat()
        taken += other.get(2 - len(taken), timeout=0.05)
    assert sorted(g.group_id for g in taken) == ["g2", "g3"]  # dead's claims, after its lease expired
    assert time.monotonic() - start >= cfg.lease_timeout_s
    live.ack(["g0", "g1"])
    with pytest.raises(ClaimLost):
        dead.ack(["g2"])  # a slow consumer whose claims were taken cannot commit them twice
    other.ack(["g2", "g3"])
    assert sorted(acked_ids(tmp_path)) == ["g0", "g1", "g2", "g3"]


def test_handles_refuse_the_role_they_were_not_opened_for(tmp_path) -> None:
    buf = ReplayBuffer(tmp_path, BufferConfig())
    with pytest.raises(ValueError, match="producer_id"):
        buf.put(make_group("g"))
    with pytest.raises(ValueError, match="consumer_id"):
        buf.get(1)
    with pytest.raises(ValueError, match="cannot name a buffer file"):
        ReplayBuffer(tmp_path, BufferConfig(), producer_id="a/b")


def test_stats_command_counts_every_state(tmp_path) -> None:
    cfg = BufferConfig()
    prod = open_buffer(cfg, tmp_path, producer_id="p")
    for version in range(5):
        prod.put(make_group(f"g{version}", version=version))
    (find_spool(tmp_path) / "pending" / "00-junk").write_text("x")  # sorts first
    cons = open_buffer(cfg, tmp_path, consumer_id="trainer")
    got = cons.get(3, timeout=0, current_version=4, max_staleness=3)  # junk quarantined, g0 stale
    cons.ack([got[0].group_id])
    out = molt("buffer", "stats", str(tmp_path)).stdout.split("\n")
    rows = {line.split()[0]: line.split()[1:] for line in out if line}
    assert rows["pending"] == ["1"] and rows["claimed"] == ["2", "(trainer:", "2)"]
    assert rows["acked"] == ["1"] and rows["stale"] == ["1"] and rows["quarantined"] == ["1"]
    missing = molt("buffer", "stats", str(tmp_path / "nope"))
    assert missing.returncode == 2 and "no replay buffer" in missing.stderr
