"""Staleness admission: how many groups the orchestrator may have in flight, and which finished group
would land too stale to train.

The trainer takes the buffer's groups in order, `actor.groups_per_step` a step, so the group accepted
as number `a` (from 0) is trained by the policy of version `a // groups_per_step`. A group made by
version `v` is therefore within `max_staleness` exactly when `a < (v + max_staleness + 1) ×
groups_per_step`. `rollout.admission` chooses how the groups in flight count against that bound:

- `bound`: each as one group that will be accepted. No accepted group is ever too stale, but under
  dynamic sampling, which drops most groups early in a run, the engines run far below the bound's
  width (16 groups in flight where only one in three is kept holds about five kept ones).
- `kept_share`: each at the share of recent finished groups that were kept, so the engines hold about
  as many groups as will be kept, divided by that share. The share is an estimate: a group that finishes
  past the bound is dropped as `stale` (counted, never put), so the bound still holds for every group
  the trainer sees, and the accepted count stays what the trainer will consume (no drift).
"""

from collections import deque

KEPT_WINDOW_STEPS = 4
"""The kept share is measured over the last this many steps' worth of finished groups: long enough to
smooth one group's luck, short enough to follow a run whose drop rate falls as it learns."""


def admits(
    accepted: int,
    in_flight: int,
    engine_version: int,
    max_staleness: int,
    groups_per_step: int,
    kept_share: float = 1.0,
) -> bool:
    """May one more group be issued now? The groups in flight count at `kept_share` each."""
    assert 0.0 < kept_share <= 1.0, kept_share
    return accepted + kept_share * in_flight < (engine_version + max_staleness + 1) * groups_per_step


def lands_stale(accepted: int, min_version: int, max_staleness: int, groups_per_step: int) -> bool:
    """Whether a kept group whose oldest token came from `min_version`, accepted now (after `accepted`
    others), would be trained more than `max_staleness` versions later."""
    return accepted >= (min_version + max_staleness + 1) * groups_per_step


class KeptShare:
    """The share of recently finished groups that were kept (not filtered, not failed), over a window of
    `KEPT_WINDOW_STEPS × groups_per_step` groups. 1 until a group finishes: admission starts as `bound`."""

    def __init__(self, groups_per_step: int):
        self.window: deque[bool] = deque(maxlen=KEPT_WINDOW_STEPS * groups_per_step)
        self.floor = 1.0 / self.window.maxlen
        """One kept group in a window: a window with none kept still counts groups in flight (the
        orchestrator's `rollout.groups_in_flight` caps them in any case)."""

    def add(self, kept: bool) -> None:
        self.window.append(kept)

    def share(self) -> float:
        if not self.window:
            return 1.0
        return max(sum(self.window) / len(self.window), self.floor)
