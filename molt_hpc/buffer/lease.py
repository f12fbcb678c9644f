"""Consumer leases: how a live consumer keeps its claims and how a dead one's claims come back.

A consumer renews its lease by rewriting `leases/<consumer>` with a new value (atomically). Another
consumer judges a lease expired when the value has not changed for `lease_timeout_s` of its *own*
monotonic clock, so expiry stays right when the nodes' clocks disagree. Expired consumers' claimed
groups are renamed back to `pending/`; if the owner was only slow, its later `ack` of those groups
fails (the rename source is gone) instead of committing them twice.
"""

import os
import time

from molt_hpc.buffer.spool import Spool, move, names
from molt_hpc.log import get_logger
from molt_hpc.rundir import atomic_write, fsync_dir


def write_lease(spool: Spool, consumer: str, serial: int) -> None:
    atomic_write(spool.leases / consumer, f"{os.getpid()} {time.time():.3f} {serial}\n")


def read_lease(spool: Spool, consumer: str) -> str | None:
    try:
        return (spool.leases / consumer).read_text()
    except FileNotFoundError:
        return None


def release(spool: Spool, consumer: str) -> int:
    """Return every group `consumer` holds to `pending/` (oldest first, so they are served first)."""
    claimed = spool.claimed / consumer
    moved = sum(move(claimed / n, spool.pending / n) for n in names(claimed))
    if moved:
        fsync_dir(spool.pending)
    return moved


class LeaseWatch:
    """Watches the other consumers' leases and releases the claims of those that stopped renewing."""

    def __init__(self, spool: Spool, me: str, timeout_s: float):
        self.spool, self.me, self.timeout_s = spool, me, timeout_s
        self._seen: dict[str, tuple[str | None, float]] = {}
        self._checked = float("-inf")

    def reap(self) -> int:
        """Release expired consumers' claims (looks at most every timeout/4 s); the number of groups released."""
        now = time.monotonic()
        if now - self._checked < self.timeout_s / 4:
            return 0
        self._checked = now
        released = 0
        for consumer in names(self.spool.claimed):
            if consumer == self.me or not names(self.spool.claimed / consumer):
                continue
            value = read_lease(self.spool, consumer)
            seen = self._seen.get(consumer)
            if seen is None or seen[0] != value:
                self._seen[consumer] = (value, now)
            elif now - seen[1] >= self.timeout_s and read_lease(self.spool, consumer) == value:
                n = release(self.spool, consumer)
                released += n
                get_logger().warning(
                    "buffer: consumer %s renewed no lease for %.1f s; returned its %d claimed group(s) to pending",
                    consumer,
                    now - seen[1],
                    n,
                )
        return released
