"""The consumer side of the buffer: claim groups with `get`, commit them with `ack`.

A claim renames `pending/NAME` into `claimed/<consumer>/`: exactly one consumer wins it, and the
others no longer see it. An ack renames the claim into `acked/` (the commit; the file is then
truncated, its name stays as the ledger entry). A consumer restarted under the same id returns
everything it held to `pending/`, so a crash before `ack` loses nothing and trains nothing twice;
the trainer acks only after the checkpoint covering those groups is published. Other consumers
take the claims of one whose lease expired (see `lease.py`). Staleness and bad files are handled
while scanning `pending/`: stale groups go to `stale/`, bad files to `quarantine/`.
"""

import math
import os
import time
from collections.abc import Iterable

from molt_hpc.buffer.codec import decode_group, read_metadata
from molt_hpc.buffer.lease import LeaseWatch, release, write_lease
from molt_hpc.buffer.spool import Spool, SpoolName, check_id, move, names, quarantine
from molt_hpc.config.infra import BufferConfig
from molt_hpc.log import get_logger
from molt_hpc.rundir import fsync_dir
from molt_hpc.trajectory import Group


class ClaimLost(RuntimeError):
    """`ack` found groups no longer claimed by this consumer (its lease expired and they went back)."""


class Consumer:
    """Takes groups out of one spool under a stable consumer id."""

    def __init__(self, spool: Spool, cfg: BufferConfig, consumer_id: str):
        self.spool, self.cfg = spool, cfg
        self.id = check_id("consumer id", consumer_id)
        self.dir = spool.claimed / consumer_id
        self.dir.mkdir(mode=0o700, exist_ok=True)
        self._claims: dict[str, str] = {}
        """Group id -> file name of every group this process holds."""
        self._acked: set[str] = set()
        self.gets = self.acks = self.stale_moved = self.quarantined = self.reaped = 0
        self._serial = 0
        self._renewed = -math.inf
        self.heartbeat()
        self._watch = LeaseWatch(spool, self.id, cfg.lease_timeout_s)
        if n := release(spool, self.id):
            get_logger().info("buffer: consumer %s returned %d unacked group(s) of its last run to pending", self.id, n)

    @property
    def claimed_ids(self) -> list[str]:
        return list(self._claims)

    def heartbeat(self) -> None:
        """Renew this consumer's lease; call it more often than `lease_timeout_s` while holding claims."""
        self._serial += 1
        write_lease(self.spool, self.id, self._serial)
        self._renewed = time.monotonic()

    def _renew(self) -> None:
        if time.monotonic() - self._renewed >= self.cfg.lease_timeout_s / 10:
            self.heartbeat()

    def get(
        self,
        n: int,
        timeout: float | None = None,
        current_version: int | None = None,
        max_staleness: int | None = None,
    ) -> list[Group]:
        """Claim up to `n` groups, oldest first, waiting up to `timeout` s (None: until there are `n`).

        With `current_version`, groups whose oldest token is more than `max_staleness` (default
        `buffer.max_staleness`) versions older are moved to `stale/` instead. Returns fewer than `n`
        groups only when the timeout passes; the claims stay held until `ack` or a restart.
        """
        if n < 1:
            raise ValueError(f"get(n={n}): ask for at least one group")
        staleness = self.cfg.max_staleness if max_staleness is None else max_staleness
        deadline = math.inf if timeout is None else time.monotonic() + timeout
        out: list[Group] = []
        delay = 0.001
        while True:
            self._renew()
            self.reaped += self._watch.reap()
            for name in names(self.spool.pending):
                if len(out) == n:
                    break
                if (group := self._take(name, current_version, staleness)) is not None:
                    out.append(group)
            now = time.monotonic()
            if len(out) == n or now >= deadline:
                self.gets += len(out)
                return out
            time.sleep(min(delay, deadline - now))
            delay = min(2 * delay, self.cfg.poll_interval_s)

    def _take(self, name: str, current_version: int | None, staleness: int) -> Group | None:
        """Claim and read one pending file; None if it was stale, bad, or taken by another consumer first."""
        src = self.spool.pending / name
        parsed = SpoolName.parse(name)
        if parsed is None:
            self.quarantined += quarantine(self.spool, src, "not a group file name (foreign file in pending/)")
            return None
        if current_version is not None and current_version - parsed.min_version > staleness:
            self.stale_moved += move(src, self.spool.stale / name)
            return None
        claimed = self.dir / name
        if not move(src, claimed):
            return None
        try:
            data = claimed.read_bytes()
            group, min_version = decode_group(data), read_metadata(data)["min_version"]  # decode checked it
            if (group.group_id, min_version) != (parsed.group_id, parsed.min_version):
                raise ValueError(f"content is group {group.group_id} v{min_version}, the name says otherwise")
            if group.group_id in self._claims:
                raise ValueError(
                    f"a second file for group {group.group_id}, already claimed as {self._claims[group.group_id]}"
                )
        except Exception as err:  # a bad file must not stop training: set it aside with its reason, go on
            self.quarantined += quarantine(self.spool, claimed, f"{type(err).__name__}: {err}")
            return None
        self._claims[group.group_id] = name
        return group

    def ack(self, group_ids: Iterable[str]) -> None:
        """Commit groups as consumed (idempotent). Ids not claimed here are committed from `pending/`
        if they wait there (a trainer resuming from a checkpoint that covered them); ClaimLost if a
        group is held by another consumer or unknown."""
        self._renew()
        lost, acks = [], self.acks
        for gid in group_ids:
            if gid in self._acked:
                continue
            if self._commit(gid):
                self._acked.add(gid)
                self.acks += 1
            else:
                lost.append(gid)
        if self.acks > acks:
            fsync_dir(self.spool.acked)
        if lost:
            raise ClaimLost(
                f"consumer {self.id} could not ack {len(lost)} group(s) {lost[:8]}: another consumer holds "
                f"them after this one renewed no lease for buffer.lease_timeout_s = {self.cfg.lease_timeout_s} s, "
                "or they were never put. Call heartbeat() more often than that while holding claims"
            )

    def _commit(self, gid: str) -> bool:
        name = self._claims.pop(gid, None)
        if name is not None and self._to_acked(self.dir / name):
            return True
        check_id("group id", gid)
        for directory in (self.dir, self.spool.pending, self.spool.acked):
            for other in names(directory):
                parsed = SpoolName.parse(other)
                if parsed is not None and parsed.group_id == gid:
                    return directory == self.spool.acked or self._to_acked(directory / other)
        return False

    def _to_acked(self, src: os.PathLike) -> bool:
        dst = self.spool.acked / os.path.basename(src)
        if not move(src, dst):
            return False
        os.truncate(dst, 0)  # the name is the ledger entry; the tensors are no longer needed
        return True
