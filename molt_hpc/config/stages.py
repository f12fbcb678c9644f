"""Config sections of the stages beyond RL: `[sft]` (`molt-hpc sft`), `[rm]` (`molt-hpc rm train`) and
`[reward_model]` (a trained reward model scoring rollouts in `molt-hpc run`).

The stages share every other section with RL: `model` is what they start from, `actor` the trainer
(ranks, device, learning rate, micro-batches, packing), `checkpoint` and `run` (name, steps, seed).
"""

from typing import Literal

from pydantic import Field, NonNegativeFloat, PositiveFloat, PositiveInt

from molt_hpc.config.base import Section


class SupervisedData(Section):
    """What SFT and reward-model training share: the files, the step batch, the length rules."""

    data: str
    """JSONL training file, relative to the working directory or absolute."""
    eval_data: str | None = None
    """Held-out JSONL file in the same format, evaluated at step 0, every `eval_every` steps and at the end."""
    eval_every: PositiveInt = 50
    """Evaluate on `eval_data` every this many steps."""
    eval_max_rows: PositiveInt = 512
    """Evaluate on at most this many rows (the first ones of the file)."""
    batch_size: PositiveInt = 32
    """Rows (SFT) or pairs (reward model) per optimizer step, over all trainer ranks; the data cycles
    epoch after epoch for `run.steps` steps, in a length-balanced order like the RL prompts'."""
    max_tokens: PositiveInt = 256
    """Longest row after the chat template (both sides of a pair, each); longer rows follow `on_overlong`."""
    length_buckets: PositiveInt = 4
    """Length-balanced order: rows sorted by length, cut into this many buckets, drawn cycling through them."""
    on_bad_row: Literal["error", "skip"] = "error"
    """A malformed row (bad JSON, no reply, overlong and dropped): stop naming file and line, or skip and count it."""


class SftConfig(SupervisedData):
    """Supervised fine-tuning (`molt-hpc sft CONFIG`): the loss is on the assistant replies only,
    found from the model's own chat template (no `{% generation %}` tags needed)."""

    train_on: Literal["all", "last"] = "all"
    """Which assistant replies of a `messages` row train: every one, or only the last. A
    `prompt`/`completion` row trains its completion's replies only."""
    on_overlong: Literal["drop", "truncate"] = "drop"
    """A row over `max_tokens`: dropped (a bad row), or cut before the first reply that does not fit
    whole (a row with no whole reply left is a bad row)."""


class RewardTrainConfig(SupervisedData):
    """Reward-model training (`molt-hpc rm train CONFIG`): Bradley-Terry on preference pairs; the result
    is an HF sequence-classification checkpoint (one label) whose score is read at the last token."""

    margin: bool = True
    """Use a row's `margin` (`-log σ(r_chosen - r_rejected - margin)`); false ignores it."""
    center_coef: NonNegativeFloat = 0.0
    """Reward centering: adds `center_coef · (r_chosen + r_rejected)²` per pair, keeping scores near 0
    (0.01 is the usual value); 0 turns it off."""


class RewardModelConfig(Section):
    """A trained reward model that scores the rollouts of `molt-hpc run`: scoring processes in the engine
    pool, called once per finished group, combined with the env's reward."""

    path: str
    """The reward model: an HF sequence-classification directory (one label), or the run directory of
    a `molt-hpc rm train` run (its latest checkpoint). It must share the policy's tokenizer: it scores
    the rollout's own tokens."""
    kind: Literal["builtin", "vllm"] = "builtin"
    """`builtin`: transformers in a molt-hpc process (CPU or GPU); `vllm`: `vllm serve` as a pooling
    (classify) model behind a token-checking front (GPUs, the `gpu` extra)."""
    count: PositiveInt = 1
    """Scoring processes, on the engine pool's first node; groups are sent to them in turn."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Scoring device; `auto` picks CUDA when available. On a GPU it takes the first GPU of the engine
    pool after the engines' (or shares the engines' when there is none left)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype the reward model runs in."""
    combine: Literal["replace", "add", "gate"] = "gate"
    """With `z` the normalised score: `replace`: reward = z; `add`: reward = env + weight·z; `gate`:
    the env's reward decides validity and z the quality: reward = env where env <= gate_threshold
    (the model is not asked), else env + weight·sigmoid(z), so every valid sample outranks every
    invalid one."""
    weight: PositiveFloat = 1.0
    """Weight of the model's term in `add` and `gate`."""
    gate_threshold: float = 0.0
    """`gate`: samples whose env reward is at most this are invalid (keep the env's reward)."""
    normalize: Literal["checkpoint", "none"] = "checkpoint"
    """`checkpoint`: z = (score - mean) / std with the held-out statistics `molt-hpc rm train` wrote into
    the model's config; `none`: z = score."""
    max_batch: PositiveInt = 64
    """Most sequences in one forward of a builtin scorer."""
    timeout_s: PositiveFloat = 60.0
    """HTTP timeout of one scoring request; a scorer that does not answer in time is tried again."""
    gpu_memory_utilization: float = Field(0.2, gt=0.0, le=1.0)
    """Fraction of GPU memory a vLLM scorer may take."""
    max_model_len: PositiveInt | None = None
    """Longest sequence a scorer accepts; unset: `engines.max_model_len` (a rollout never exceeds it)."""
    extra_args: list[str] = Field(default_factory=list)
    """Extra command-line arguments for a vLLM scorer's `vllm serve`."""
