"""Procedurally generated rows (`[data.generator]`, `[eval.generator]`): reasoning-gym tasks by name, size and
seed, so a run needs no downloaded dataset."""

from typing import Any, Literal

from pydantic import Field, NonNegativeInt, PositiveInt

from molt_hpc.config.base import Section


class TaskSpec(Section):
    """One reasoning-gym task's share of the rows."""

    name: str
    """The task's registered name (`basic_arithmetic`, `chain_sum`, `simple_equations`, ...; ~100 exist)."""
    size: PositiveInt
    """Rows generated from it."""
    seed: NonNegativeInt = 0
    """Row i is drawn from `Random(seed + i)`: train and eval tasks of one name must use disjoint ranges
    `[seed, seed + size)`, so no held-out row is a training row."""
    config: dict[str, Any] = Field(default_factory=dict)
    """The task's own config fields (e.g. `{min_terms = 2, max_terms = 3}`), as reasoning-gym names them."""

    @property
    def seeds(self) -> range:
        return range(self.seed, self.seed + self.size)


class GeneratorConfig(Section):
    """Rows generated once into the run directory and scored by the task's own scorer (`envs/reasoning_gym.py`)."""

    kind: Literal["reasoning_gym"] = "reasoning_gym"
    """The generator library: `reasoning_gym` (procedural arithmetic, algebra, logic, games)."""
    tasks: list[TaskSpec] = Field(min_length=1)
    """The tasks and how many rows each gives, in order."""


def overlapping_seeds(train: GeneratorConfig, held_out: GeneratorConfig) -> str | None:
    """The first task whose training and held-out seed ranges overlap, described; None when all are disjoint."""
    for a in train.tasks:
        for b in held_out.tasks:
            if a.name == b.name and a.seeds.start < b.seeds.stop and b.seeds.start < a.seeds.stop:
                return (
                    f"task {a.name!r}: data.generator seeds [{a.seeds.start}, {a.seeds.stop}) and eval.generator "
                    f"seeds [{b.seeds.start}, {b.seeds.stop}) overlap"
                )
    return None
