"""The contract between the trainer's loop (`trainer.Trainer`) and what it trains: a `Task`.

A task owns its models, where its batches come from, its update and the work around a step; the loop
owns the step count, checkpoints, control requests and records. RL's task is `rl.RlTask`, the
supervised stages' `supervised.StageTask`; both subclass `Task` to take its do-nothing hooks.
"""

from pathlib import Path
from typing import Any, Protocol

from molt_hpc.actor.control import Control, Requests
from molt_hpc.actor.state import Trainable
from molt_hpc.rundir import RunDir


class Task(Protocol):
    """What one kind of training adds to the loop. Every method but `resume_point` runs on every rank; the
    hooks with a body do nothing by default."""

    def resume_point(self, run: RunDir, base: Path, required: bool) -> Path | None:
        """The verified checkpoint to resume from, checked against this task's models (rank 0)."""
        ...

    def build(self, base: Path, ckpt: Path | None) -> list[Trainable]:
        """Load the models (from `ckpt` when resuming, else `base`) and the data; the trained parts."""
        ...

    def restore(self, run_state: dict[str, Any]) -> None:
        """Take back the task's own part of a checkpoint's run state (its data position)."""
        ...

    def run_state(self) -> dict[str, Any]:
        """The task's own keys of the run state a checkpoint saves."""
        ...

    def saved(self, run_state: dict[str, Any]) -> None:
        """A checkpoint with `run_state` was published (RL acks the groups it covers)."""

    def next_batch(self, version: int, control: Control) -> tuple[Any | None, Requests]:
        """The next step's batch (None: no step now) and the requests the loop serves first."""
        ...

    def train(self, batch: Any) -> dict[str, Any]:
        """One optimizer step on `batch`; its record fields (`tokens` among them)."""
        ...

    def after_step(self, step: int, batch: Any) -> dict[str, Any]:
        """The work after step `step` trained `batch`, before its checkpoint; record fields it adds."""
        ...

    def step_end(self, wait_s: float, checkpoint_s: float | None) -> dict[str, Any]:
        """Record fields of the whole iteration, read after its checkpoint."""
        return {}

    def serve(self, req: Requests, version: int) -> None:
        """Requests beyond checkpoint and stop (RL: the engines changed, refit)."""

    def start(self, step: int) -> dict[str, Any] | None:
        """Before the first step of this process; a record to write, if any."""
        return None

    def finish(self, step: int) -> None:
        """After the last step, before the final checkpoint."""

    def close(self) -> None:
        """Close what the task opened."""
