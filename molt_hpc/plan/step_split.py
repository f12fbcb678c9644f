"""Where a run's training steps spend their time, from its `metrics.jsonl` actor records.

Every actor record carries `wait_s` (waiting for a batch of rollouts, engine changes served meanwhile),
`step_s` (the training step), `refit_s` (the refit after it) and `checkpoint_s` (when one was written);
their sum is the step's wall time. `bench/step_split.py` prints the table; `molt-hpc status` sets the
means beside the plan's prediction.
"""

PARTS = {"wait_s": "rollout wait", "step_s": "train", "refit_s": "refit", "checkpoint_s": "checkpoint"}


def split(records: list[dict]) -> dict[str, list[float]]:
    """Each part's seconds per step (0 where a step had none of it, e.g. no checkpoint)."""
    return {key: [float(r.get(key) or 0.0) for r in records] for key in PARTS}
