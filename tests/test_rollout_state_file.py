"""The orchestrator's state file: writes coalesced to one per `SAVE_EVERY_S`, at once when asked, and a
changed state written by the loop's tick once due. (That a restart from a lagging file loses and duplicates
nothing is `test_rollout_orchestrator.py::test_kill_9_at_random_points_loses_and_duplicates_nothing`.)"""

from molt_hpc.data import Position
from molt_hpc.rollout.state import SAVE_EVERY_S, RolloutState, StateFile


def on_disk(f: StateFile) -> RolloutState:
    return RolloutState.load(f.path)


def test_writes_are_coalesced_and_written_once_due(tmp_path) -> None:
    f = StateFile(tmp_path / "rollout" / "state.json")
    state = f.load()
    assert state.groups_accepted == 0 and not f.path.exists()  # a fresh run: nothing yet
    state.in_flight.append(Position(0, 0))
    f.save(state)  # the first change: written at once
    assert on_disk(f).in_flight == [Position(0, 0)]
    for i in range(1, 50):  # a burst of issues within the interval: none written
        state.in_flight.append(Position(0, i))
        f.save(state)
    f.tick(state)
    assert on_disk(f).in_flight == [Position(0, 0)] and f.changed
    f.saved_at -= SAVE_EVERY_S  # the interval has passed since the last write
    f.tick(state)
    assert len(on_disk(f).in_flight) == 50 and not f.changed
    f.tick(state)  # nothing changed since: no write
    assert not f.changed
    state.groups_accepted, state.last_eval_version = 7, 3
    f.save(state, now=True)  # an evaluation's version or the shutdown: at once
    assert (on_disk(f).groups_accepted, on_disk(f).last_eval_version) == (7, 3)
    assert oct(f.path.stat().st_mode & 0o777) == oct(0o600)  # the run's records stay private
