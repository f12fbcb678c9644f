"""The orchestrator's durable state: the data cursor, the groups in flight, the counters.

Written atomically to `RUN_DIR/rollout/state.json` (write-ahead): a group is recorded as in flight
*before* it is issued, and leaves that list only after it reached the buffer or was deliberately
dropped. A restart re-issues every group still listed, under the same deterministic id, and the
buffer's producer ledger (`was_put`) skips those that did reach it just before the crash — so no
prompt is skipped and none reaches the buffer twice.
"""

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from molt_hpc.data import Position
from molt_hpc.rundir import atomic_write

STATE_VERSION = 1


@dataclass
class RolloutState:
    cursor: dict[str, Any] | None = None
    """`Cursor.state()`: the next draw."""
    in_flight: list[Position] = field(default_factory=list)
    """Issued groups not yet in the buffer (nor dropped), in issue order."""
    groups_accepted: int = 0
    """Groups put into the buffer over the run (what staleness admission counts)."""
    groups_dropped: int = 0
    """Groups dropped by filters or failures over the run."""
    last_eval_version: int = -1
    """Policy version of the last evaluation (-1: none yet)."""

    def to_json(self) -> str:
        return json.dumps(
            {
                "format": STATE_VERSION,
                "cursor": self.cursor,
                "in_flight": [[p.epoch, p.index] for p in self.in_flight],
                "groups_accepted": self.groups_accepted,
                "groups_dropped": self.groups_dropped,
                "last_eval_version": self.last_eval_version,
            },
            indent=1,
        )

    def save(self, path: Path) -> None:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        atomic_write(path, self.to_json())

    @classmethod
    def load(cls, path: Path) -> "RolloutState":
        """The saved state, or a fresh one when the run has none yet."""
        if not path.exists():
            return cls()
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} is corrupt ({err}); delete it to re-issue from the start of the data") from None
        if data.get("format") != STATE_VERSION:
            raise ValueError(f"{path}: unknown rollout state format {data.get('format')!r}")
        return cls(
            cursor=data["cursor"],
            in_flight=[Position(int(e), int(i)) for e, i in data["in_flight"]],
            groups_accepted=int(data["groups_accepted"]),
            groups_dropped=int(data["groups_dropped"]),
            last_eval_version=int(data["last_eval_version"]),
        )
