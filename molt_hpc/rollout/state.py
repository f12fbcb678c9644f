"""The orchestrator's durable state: the data cursor, the groups in flight, the counters.

Written atomically to `RUN_DIR/rollout/state.json`, at most every `SAVE_EVERY_S` (`StateFile`): each
write is two fsyncs, and the orchestrator's event loop, which streams every request's tokens, would
otherwise wait for two of them per group issued and two per group finished (on a parallel file system,
milliseconds each). A saved state therefore lags the live one by less than `SAVE_EVERY_S`, and a restart
loses nothing by it: it re-issues every group the saved state lists in flight, then the cursor goes on
from the saved position, so the groups issued since are issued again, each under its deterministic id;
the buffer's producer ledger (`was_put`) counts those that reached the buffer without running them
again. No prompt is skipped and none reaches the buffer twice; a group dropped (dynamic sampling) since
the save runs again.
"""

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from molt_hpc.data import Position
from molt_hpc.rundir import atomic_write

STATE_VERSION = 1
SAVE_EVERY_S = 0.5
"""The longest a changed state waits for its write (`StateFile`)."""


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


class StateFile:
    """`state.json` written when due: `save` marks the state changed and writes it when `SAVE_EVERY_S` have
    passed since the last write (`now=True`: at once); `tick` writes a changed state that has come due."""

    def __init__(self, path: Path):
        self.path, self.changed, self.saved_at = path, False, float("-inf")

    def load(self) -> RolloutState:
        return RolloutState.load(self.path)

    def save(self, state: RolloutState, now: bool = False) -> None:
        self.changed = True
        if now:
            self.saved_at = float("-inf")
        self.tick(state)

    def tick(self, state: RolloutState) -> None:
        if self.changed and time.monotonic() - self.saved_at >= SAVE_EVERY_S:
            state.save(self.path)
            self.changed, self.saved_at = False, time.monotonic()
