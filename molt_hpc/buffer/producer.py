"""The producer side of the buffer: `put` with backpressure, idempotent on group id across restarts.

One put, in order: wait while `capacity` groups are pending; write `tmp/<producer>/NAME` and fsync
it; create the marker `producers/<producer>/<group_id>`; rename the file into `pending/`. A kill at
any point leaves one of three states, each resolved when the producer restarts under the same id:
  - no marker: the group was never put (any partial file is deleted; `put` writes it again);
  - marker and file in tmp: complete but unpublished: it is published at start-up;
  - marker, no file in tmp: published; `put` of that id again returns False and writes nothing.
So a rollout orchestrator that gives groups deterministic ids (e.g. from the dataset position) can
re-issue its in-flight groups after a crash and none is duplicated: `was_put(id)` says which to
skip, and `put` of an already-put id is a no-op. One live process per producer id at a time.
"""

import os
import time

from molt_hpc.buffer.codec import encode_group, read_metadata
from molt_hpc.buffer.spool import Spool, SpoolName, check_id, count, move
from molt_hpc.config.infra import BufferConfig
from molt_hpc.log import get_logger
from molt_hpc.rundir import fsync_dir
from molt_hpc.trajectory import Group


def _write_synced(path: os.PathLike, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


class Producer:
    """Puts groups into one spool under a stable producer id."""

    def __init__(self, spool: Spool, cfg: BufferConfig, producer_id: str):
        self.spool, self.cfg = spool, cfg
        self.id = check_id("producer id", producer_id)
        self.tmp = spool.tmp / producer_id
        self.marks = spool.producers / producer_id
        for d in (self.tmp, self.marks):
            d.mkdir(mode=0o700, exist_ok=True)
        self.seq = 0
        self.puts = 0
        self.blocked_s = 0.0
        """Total seconds `put` has waited for room (the backpressure metric)."""
        self.last_blocked_s = 0.0
        self._recover()

    def _recover(self) -> None:
        """Finish or undo the put a previous process under this id was killed in."""
        published = 0
        for name in os.listdir(self.tmp):
            parsed = SpoolName.parse(name)
            if parsed is not None and self.was_put(parsed.group_id):
                published += move(self.tmp / name, self.spool.pending / name)
            else:
                os.unlink(self.tmp / name)
        if published:
            fsync_dir(self.spool.pending)
            get_logger().info("buffer: producer %s published %d group(s) left by its last run", self.id, published)

    def was_put(self, group_id: str) -> bool:
        """Whether this producer (in this or an earlier process) has put `group_id`."""
        return (self.marks / check_id("group id", group_id)).exists()

    def put(self, group: Group) -> bool:
        """Publish `group`, blocking while the spool is full; False if its id was already put (nothing written)."""
        if self.was_put(group.group_id):
            return False
        data = encode_group(group)  # first: a group it cannot store raises before any waiting
        min_version = read_metadata(data)["min_version"]
        self._wait_for_room()
        name = str(SpoolName(time.time_ns(), self.id, self.seq, min_version, group.group_id))
        self.seq += 1
        _write_synced(self.tmp / name, data)
        os.close(os.open(self.marks / group.group_id, os.O_WRONLY | os.O_CREAT, 0o600))
        fsync_dir(self.marks)
        os.rename(self.tmp / name, self.spool.pending / name)
        fsync_dir(self.spool.pending)
        self.puts += 1
        return True

    def _wait_for_room(self) -> None:
        """Block while `capacity` groups are pending (claimed ones do not count); raise after `put_timeout_s`."""
        start = time.monotonic()
        delay = 0.001
        while (pending := count(self.spool.pending)) >= self.cfg.capacity:
            waited = time.monotonic() - start
            if waited >= self.cfg.put_timeout_s:
                self._account(start)
                raise TimeoutError(
                    f"replay buffer {self.spool.root} has held {pending} pending groups (buffer.capacity = "
                    f"{self.cfg.capacity}) for {waited:.0f} s: is the trainer (the consumer) running and taking "
                    "groups? Check its log and `molt-hpc buffer stats RUN_DIR`; raise buffer.put_timeout_s "
                    "if it is only slow"
                )
            time.sleep(min(delay, self.cfg.put_timeout_s - waited))
            delay = min(2 * delay, self.cfg.poll_interval_s)
        self._account(start)

    def _account(self, start: float) -> None:
        self.last_blocked_s = time.monotonic() - start
        self.blocked_s += self.last_blocked_s
