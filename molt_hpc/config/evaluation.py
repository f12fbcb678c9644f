"""The `[eval]` section: held-out evaluation as papers report it (n samples per prompt, pass@k, mean reward)."""

import re

from pydantic import Field, NonNegativeFloat, PositiveInt, model_validator

from molt_hpc.config.base import Section
from molt_hpc.config.generator import GeneratorConfig

BEST_METRIC_RE = re.compile(r"pass@(\d+)|reward|score")


class EvalConfig(Section):
    """Held-out evaluation, concurrent with training: every `every` policy versions (and at version 0 and at
    the end of the run) each of the first `max_prompts` held-out prompts is sampled `n` times; the record
    has the unbiased pass@k (Chen et al. 2021) for each k of `k`, and the mean reward and score. Greedy
    one-sample evaluation is `n = 1, temperature = 0`."""

    path: str | None = None
    """File of held-out rows, in the format of `data.path`."""
    generator: GeneratorConfig | None = None
    """Generate the held-out rows instead (`[eval.generator]`), into `RUN_DIR/data/eval.jsonl`; a task also in
    `data.generator` must use a disjoint seed range."""
    n: PositiveInt = 1
    """Samples per prompt."""
    temperature: NonNegativeFloat = 0.0
    """Sampling temperature of the evaluation; 0 is greedy (the arg-max token: then `n` samples are the same)."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling of the evaluation (with temperature > 0)."""
    k: list[PositiveInt] = Field(default_factory=lambda: [1])
    """The k of each pass@k reported (`eval_pass@k`); each at most `n`."""
    pass_threshold: float = 1.0
    """A sample passes when its score (the env's `score`, else its reward) is at least this."""
    every: PositiveInt = 10
    """Evaluate the policy at version 0 and then every this many versions, and at the end of the run."""
    max_prompts: PositiveInt = 64
    """Evaluate on at most this many rows (the first ones)."""
    best_metric: str | None = None
    """`pass@K` (a K of `k`), `reward` or `score`: `checkpoints/best` names the checkpoint whose evaluation
    scored highest in it (`molt_hpc.checkpoint`); None keeps no best."""

    @model_validator(mode="after")
    def _check(self) -> "EvalConfig":
        if (self.path is None) == (self.generator is None):
            raise ValueError("[eval] needs one of `path` (a file of held-out rows) and `generator`")
        over = [k for k in self.k if k > self.n]
        if over:
            raise ValueError(f"eval.k = {self.k} has k > eval.n = {self.n}: pass@{over[0]} needs n >= {over[0]}")
        if self.best_metric is not None:
            m = BEST_METRIC_RE.fullmatch(self.best_metric)
            if m is None or (m.group(1) is not None and int(m.group(1)) not in self.k):
                choices = ", ".join([*(f'"pass@{k}"' for k in self.k), '"reward"', '"score"'])
                raise ValueError(f"eval.best_metric = {self.best_metric!r}: use one of {choices}")
        return self

    @property
    def metric_key(self) -> str | None:
        """The metrics key `best_metric` reads (`eval_pass@1`, `eval_reward`)."""
        return None if self.best_metric is None else f"eval_{self.best_metric}"
