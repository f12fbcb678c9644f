"""Fault injection with real processes: kill -9 producers and consumers, then audit the ack ledger.

Workers are forked from the test process after it has imported the buffer: each is a real process
(own memory, own file descriptors, killed with SIGKILL), but it starts in milliseconds instead of
the ~0.4 s a fresh interpreter spends importing numpy, safetensors and pydantic, so hundreds of
kills fit in the test budget. Workers import no torch.
"""

import contextlib
import os
import random
import signal
import time
import traceback
from collections import Counter
from pathlib import Path

import pytest

from molt_hpc.buffer import ClaimLost, ReplayBuffer, acked_ids, spool_counts
from molt_hpc.buffer import consumer as consumer_mod
from molt_hpc.buffer import producer as producer_mod
from molt_hpc.buffer.spool import count
from molt_hpc.config.infra import BufferConfig
from tests.test_buffer import make_group

CRASH = 77
PRODUCERS, CONSUMERS, GROUPS_PER_ROUND, KILLS = 3, 2, 30, 220
CFG = BufferConfig(capacity=6, lease_timeout_s=0.5, poll_interval_s=0.01)


def fork(fn, *args) -> int:
    """Run `fn(*args)` in a child process; exit code 0 on return, 1 on an exception."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            random.seed(os.getpid())
            fn(*args)
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    return pid


def wait(pid: int) -> int:
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def expected_group(gid: str):
    return make_group(gid, version=0, n=2, length=10 + int(gid.rsplit("g", 1)[1]) % 5)


def produce(root: Path, name: str, ids: list[str]) -> None:
    """Put this producer's deterministic groups, skipping what an earlier life already put."""
    buf = ReplayBuffer(root, CFG, producer_id=name)
    for gid in ids:
        if not buf.was_put(gid):
            buf.put(expected_group(gid))


def consume(root: Path, name: str, total: int) -> None:
    """Claim, check, 'train' briefly, ack; until the ledger holds every group."""
    buf = ReplayBuffer(root, CFG, consumer_id=name)
    while count(root / "acked") < total:
        groups = buf.get(random.randint(1, 4), timeout=0.05)
        for g in groups:
            assert g == expected_group(g.group_id), f"group {g.group_id} came back different"
        time.sleep(random.uniform(0, 0.01))
        # ClaimLost: this consumer was too slow and its claims were taken; whoever holds them acks them
        with contextlib.suppress(ClaimLost):
            buf.ack([g.group_id for g in groups])


class Fleet:
    """The worker processes by name: kill one at random, restart it now or later, reap finished ones."""

    def __init__(self, workers: dict[str, tuple]):
        self.workers = workers
        self.pids: dict[str, int | None] = {name: fork(fn, *args) for name, (fn, args) in workers.items()}
        self.restart_at: dict[str, float] = {}
        self.kills: Counter = Counter()

    def live(self) -> list[str]:
        return sorted(name for name, pid in self.pids.items() if pid is not None)

    def step(self) -> None:
        """Reap workers that finished (they must exit 0) and restart those whose time has come."""
        for name, pid in self.pids.items():
            if pid is not None and (status := os.waitpid(pid, os.WNOHANG))[0]:
                self.pids[name] = None
                assert os.waitstatus_to_exitcode(status[1]) == 0, f"worker {name} failed (see its traceback)"
            if self.pids[name] is None and self.restart_at.get(name, float("inf")) <= time.monotonic():
                del self.restart_at[name]
                fn, args = self.workers[name]
                self.pids[name] = fork(fn, *args)

    def kill(self, name: str, restart_in: float) -> None:
        pid, self.pids[name] = self.pids[name], None
        os.kill(pid, signal.SIGKILL)
        code = wait(pid)
        if code == 0:  # it finished its work just before the signal
            return
        assert code == -signal.SIGKILL, f"worker {name} failed (see its traceback)"
        self.kills[name[0]] += 1
        self.restart_at[name] = time.monotonic() + restart_in

    def close(self) -> None:
        for pid in filter(None, self.pids.values()):
            os.kill(pid, signal.SIGKILL)  # live or a zombie not reaped yet: either way it can be signalled
            wait(pid)


def run_round(root: Path, ids: dict[str, list[str]], total: int, kills_left: int, rng: random.Random) -> Counter:
    """Start producers (each with its ids) and consumers, kill -9 random ones until `kills_left` or the
    work is done, let them finish; the kills made."""
    workers = {name: (produce, (root, name, gids)) for name, gids in ids.items()}
    workers |= {f"c{i}": (consume, (root, f"c{i}", total)) for i in range(CONSUMERS)}
    deadline = time.monotonic() + 60
    fleet = Fleet(workers)
    try:
        while sum(fleet.kills.values()) < kills_left and fleet.live():
            assert time.monotonic() < deadline, f"stuck after {dict(fleet.kills)} kills: {spool_counts(root)}"
            time.sleep(rng.uniform(0.002, 0.02))
            fleet.step()
            if live := fleet.live():
                victim = rng.choice(live)
                # a fifth of consumer restarts come late, after the lease ran out: the other consumer takes over
                late = victim.startswith("c") and rng.random() < 0.2
                fleet.kill(victim, rng.uniform(0.6, 1.0) if late else 0.0)
        while fleet.live() or fleet.restart_at:
            assert time.monotonic() < deadline, f"workers did not finish: {spool_counts(root)}"
            time.sleep(0.02)
            fleet.step()
    finally:  # a failed run must not leave workers behind
        fleet.close()
    return fleet.kills


def test_kill9_producers_and_consumers_none_lost_none_twice(tmp_path) -> None:
    """Rounds of work in one spool until enough kills landed (rounds keep it independent of machine speed)."""
    rng = random.Random(1234)
    put: list[str] = []
    kills: Counter = Counter()
    for r in range(100):
        if sum(kills.values()) >= KILLS:
            break
        ids = {f"p{i}": [f"r{r}-p{i}-g{k}" for k in range(GROUPS_PER_ROUND)] for i in range(PRODUCERS)}
        put += [gid for gids in ids.values() for gid in gids]
        kills += run_round(tmp_path, ids, len(put), KILLS - sum(kills.values()), rng)
    print(f"{r} rounds, {len(put)} groups, kills {dict(kills)}")
    assert sum(kills.values()) >= KILLS and kills["p"] >= 40 and kills["c"] >= 40, dict(kills)
    assert Counter(acked_ids(tmp_path)) == Counter(put)
    counts = spool_counts(tmp_path)
    assert (counts["pending"], counts["claimed"], counts["writing"]) == (0, 0, 0)
    assert (counts["stale"], counts["quarantined"]) == (0, 0)


def _crash(*_args, **_kwargs) -> None:
    os._exit(CRASH)


def _half_write(path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, data[: len(data) // 2])
    os._exit(CRASH)


@pytest.mark.parametrize(
    ("patch", "was_put", "left_in_tmp"),
    [
        pytest.param(lambda: setattr(producer_mod, "_write_synced", _half_write), False, 1, id="mid-write"),
        pytest.param(lambda: setattr(producer_mod, "fsync_dir", _crash), True, 1, id="marked-not-published"),
        pytest.param(lambda: setattr(os, "rename", lambda *a: (os.replace(*a), _crash())), True, 0, id="published"),
    ],
)
def test_producer_killed_inside_put_recovers_exactly_once(tmp_path, patch, was_put: bool, left_in_tmp: int) -> None:
    def crash_in_put() -> None:
        buf = ReplayBuffer(tmp_path, CFG, producer_id="p")
        patch()
        buf.put(make_group("g0"))

    assert wait(fork(crash_in_put)) == CRASH
    assert spool_counts(tmp_path)["writing"] == left_in_tmp
    again = ReplayBuffer(tmp_path, CFG, producer_id="p")  # the restart finishes or undoes the put
    assert again.was_put("g0") == was_put
    assert again.put(make_group("g0")) != was_put
    cons = ReplayBuffer(tmp_path, CFG, consumer_id="c")
    cons.ack([g.group_id for g in cons.get(5, timeout=0.05)])
    assert acked_ids(tmp_path) == ["g0"]
    assert spool_counts(tmp_path)["writing"] == 0


def test_consumer_killed_after_claim_before_read_returns_the_group(tmp_path) -> None:
    ReplayBuffer(tmp_path, CFG, producer_id="p").put(make_group("g0"))

    def crash_in_get() -> None:
        consumer_mod.decode_group = _crash
        ReplayBuffer(tmp_path, CFG, consumer_id="c").get(1)

    assert wait(fork(crash_in_get)) == CRASH
    assert spool_counts(tmp_path)["claimed_by"] == {"c": 1}
    cons = ReplayBuffer(tmp_path, CFG, consumer_id="c")
    assert [g.group_id for g in cons.get(1, timeout=0)] == ["g0"]


def test_consumer_killed_inside_ack_keeps_the_commit(tmp_path) -> None:
    ReplayBuffer(tmp_path, CFG, producer_id="p").put(make_group("g0"))

    def crash_in_ack() -> None:
        buf = ReplayBuffer(tmp_path, CFG, consumer_id="c")
        groups = buf.get(1)
        os.truncate = _crash  # killed after the commit rename, before the payload is dropped
        buf.ack([g.group_id for g in groups])

    assert wait(fork(crash_in_ack)) == CRASH
    cons = ReplayBuffer(tmp_path, CFG, consumer_id="c")
    assert cons.get(1, timeout=0.05) == []
    cons.ack(["g0"])  # the resumed trainer re-acks what its checkpoint covered: a no-op
    assert acked_ids(tmp_path) == ["g0"]
