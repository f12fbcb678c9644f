"""The replay buffer: a crash-safe spool of finished groups, the only data path from rollout to training.

    buf = open_buffer(cfg.buffer, run_dir, producer_id="rollout")   # engine pool (orchestrator)
    buf.put(group)                                                   # blocks while the spool is full

    buf = open_buffer(cfg.buffer, run_dir, consumer_id="trainer")   # actor pool, rank 0
    groups = buf.get(8, timeout=60, current_version=version)         # claims them
    ...train, publish the checkpoint that covers them...
    buf.ack([g.group_id for g in groups])                            # commits them

The `fs` backend spools in `RUN_DIR/buffer/` (a shared filesystem); `shm` in a directory under
`/dev/shm` named after the run, with `RUN_DIR/buffer/location` pointing at it. Both take the same
code paths. After any crash, reopening yields exactly the groups put and not acked: see
`producer.py` (idempotent put), `consumer.py` (claim/commit) and `spool.py` (the layout), with
`codec.py` (one `Group` as one safetensors file), `lease.py` (consumer leases: how a dead consumer's
claims come back) and `cleanup.py` (removing a run's `/dev/shm` spool).
"""

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from molt_hpc.buffer.consumer import ClaimLost, Consumer
from molt_hpc.buffer.producer import Producer
from molt_hpc.buffer.spool import LOCATION_FILE, Spool, acked_ids, count, find_spool, shm_root, spool_counts
from molt_hpc.config.infra import BufferConfig
from molt_hpc.rundir import atomic_write
from molt_hpc.trajectory import Group

__all__ = ["ClaimLost", "ReplayBuffer", "acked_ids", "find_spool", "open_buffer", "spool_counts"]


class ReplayBuffer:
    """One process's handle on a spool: a producer (`put`), a consumer (`get`/`ack`), or both.

    Ids must be stable across restarts: a restarted producer uses its id to finish or skip what
    it had put, a restarted consumer to return what it had claimed. One live process per id.
    """

    def __init__(
        self, root: str | Path, cfg: BufferConfig, consumer_id: str | None = None, *, producer_id: str | None = None
    ):
        self.cfg = cfg
        self.spool = Spool(Path(root)).create()
        self._producer = Producer(self.spool, cfg, producer_id) if producer_id is not None else None
        self._consumer = Consumer(self.spool, cfg, consumer_id) if consumer_id is not None else None

    @property
    def root(self) -> Path:
        return self.spool.root

    def _as_producer(self) -> Producer:
        if self._producer is None:
            raise ValueError("this buffer handle has no producer: open it with producer_id=<stable name>")
        return self._producer

    def _as_consumer(self) -> Consumer:
        if self._consumer is None:
            raise ValueError("this buffer handle has no consumer: open it with consumer_id=<stable name>")
        return self._consumer

    def put(self, group: Group) -> bool:
        """Publish a group (blocks while `capacity` are pending); False if this producer already put its id."""
        return self._as_producer().put(group)

    def was_put(self, group_id: str) -> bool:
        """Whether this producer already put `group_id` (before a restart included)."""
        return self._as_producer().was_put(group_id)

    def get(
        self, n: int, timeout: float | None = None, current_version: int | None = None, max_staleness: int | None = None
    ) -> list[Group]:
        """Claim up to `n` groups, oldest first; see `Consumer.get`."""
        return self._as_consumer().get(n, timeout, current_version, max_staleness)

    def ack(self, group_ids: Iterable[str]) -> None:
        """Commit claimed groups as consumed (idempotent); see `Consumer.ack`."""
        self._as_consumer().ack(group_ids)

    def heartbeat(self) -> None:
        """Renew the consumer's lease (while holding claims for long, e.g. until the next checkpoint)."""
        self._as_consumer().heartbeat()

    def stats(self) -> dict[str, Any]:
        """Cheap metrics for the process's log: pending groups and this handle's counters."""
        out: dict[str, Any] = {"buffer_pending": count(self.spool.pending)}
        if (p := self._producer) is not None:
            out.update(buffer_puts=p.puts, buffer_put_blocked_s=p.blocked_s, buffer_last_put_blocked_s=p.last_blocked_s)
        if (c := self._consumer) is not None:
            out.update(
                buffer_claimed=len(c.claimed_ids),
                buffer_gets=c.gets,
                buffer_acks=c.acks,
                buffer_stale=c.stale_moved,
                buffer_quarantined=c.quarantined,
                buffer_reaped=c.reaped,
            )
        return out


def spool_root(cfg: BufferConfig, run_dir: str | Path) -> Path:
    """Where a run's spool lives for `cfg.backend` (shm: also records it in `RUN_DIR/buffer/location`)."""
    buffer_dir = Path(run_dir) / "buffer"
    if cfg.backend == "fs":
        (buffer_dir / LOCATION_FILE).unlink(missing_ok=True)  # the run moved off shm: the pointer is stale
        return buffer_dir
    root = shm_root(run_dir)
    buffer_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    atomic_write(buffer_dir / LOCATION_FILE, f"{root}\n")
    return root


def open_buffer(
    cfg: BufferConfig, run_dir: str | Path, *, producer_id: str | None = None, consumer_id: str | None = None
) -> ReplayBuffer:
    """The run's replay buffer on the configured backend."""
    return ReplayBuffer(spool_root(cfg, run_dir), cfg, consumer_id, producer_id=producer_id)
