"""Groups from the replay buffer to every rank, and the buffer commit protocol.

Rank 0 claims groups (stale ones are moved aside by the buffer against the current policy
version) and shares each full batch with every rank. Trained groups stay claimed until the
checkpoint that covers them is published; only then does rank 0 ack them. A crash before that
returns them to the pool, to be trained again from the restored state.
"""

from collections import Counter
from pathlib import Path
from typing import Any

from molt_hpc.actor.control import Control, Requests
from molt_hpc.actor.sync import EngineSync
from molt_hpc.actor.world import World, share
from molt_hpc.buffer import open_buffer
from molt_hpc.config import MoltConfig
from molt_hpc.trajectory import Group

CONSUMER_ID = "trainer"
POLL_S = 1.0


class Feed:
    """The trainer's side of the buffer (the buffer itself lives on rank 0 only)."""

    def __init__(self, cfg: MoltConfig, run_dir: Path, world: World):
        self.world = world
        self.buffer = open_buffer(cfg.buffer, run_dir, consumer_id=CONSUMER_ID) if world.is_main else None
        self.pending: list[Group] = []
        self.trained: list[str] = []
        """Ids of groups trained since the last checkpoint (rank 0)."""
        self.last_position: dict[str, int] = {}

    def fetch(self, n: int, version: int, control: Control, sync: EngineSync) -> tuple[list[Group] | None, Requests]:
        """Wait for `n` groups or a request (checkpoint, stop, engines changed); returns the batch (None
        if not ready or stopping) and the requests, which the caller serves."""
        while True:
            if self.buffer is not None and len(self.pending) < n:
                self.pending += self.buffer.get(n - len(self.pending), timeout=POLL_S, current_version=version)
            req = control.poll(ready=len(self.pending) >= n, refit=sync.wants_refit())
            if req.ready or req.checkpoint or req.stop or req.refit:
                break
        if not req.ready or req.stop:
            return None, req
        groups = share(self.pending[:n] if self.world.is_main else None)
        self.pending = self.pending[n:]
        return groups, req

    def record(self, groups: list[Group]) -> None:
        """`groups` were trained: they are acked after the next checkpoint."""
        self.trained += [g.group_id for g in groups]
        for g in groups:
            if g.data_position and _position_key(g.data_position) > _position_key(self.last_position):
                self.last_position = dict(g.data_position)

    def state(self) -> dict[str, Any]:
        """What the checkpoint records: the groups it covers and the dataset position reached."""
        return {"trained_groups": list(self.trained), "data_position": self.last_position}

    def commit(self, ids: list[str] | None = None) -> None:
        """Ack the groups a published checkpoint covers (rank 0); by default those trained until now."""
        ids = list(self.trained) if ids is None else ids
        if self.buffer is not None and ids:
            self.buffer.ack(ids)
        self.trained = [g for g in self.trained if g not in set(ids)]

    def heartbeat(self) -> None:
        if self.buffer is not None:
            self.buffer.heartbeat()

    def stats(self) -> dict[str, Any]:
        return self.buffer.stats() if self.buffer is not None else {}


def staleness_histogram(groups: list[Group], version: int) -> dict[str, int]:
    """Groups per staleness (current version minus the oldest version that produced a token)."""
    counts = Counter(version - g.min_version for g in groups)
    return {str(k): counts[k] for k in sorted(counts)}


def _position_key(pos: dict[str, int]) -> tuple[int, int]:
    return pos.get("epoch", 0), pos.get("index", 0)
