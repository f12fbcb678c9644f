"""Typed request bodies of the engines' routes (no torch: the router and the vLLM front validate with them too).

Each stateful route parses its body into one of these before it acts, so a refused body (400)
leaves the engine as it was: the live refit channel, the pause state, the weight version.
"""

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

PAUSE_MODES = ("abort", "wait", "keep")
GROUP_FIELDS = ("master_address", "master_port", "rank_offset", "world_size")
STRICT = ConfigDict(strict=True, extra="forbid", frozen=True, allow_inf_nan=False)


class PauseRequest(BaseModel):
    """Body of `POST /pause` (the `mode` query parameter wins over the body's)."""

    model_config = STRICT

    mode: Literal["abort", "wait", "keep"] | None = None


class ResumeRequest(BaseModel):
    """Body of `POST /resume` (optional)."""

    model_config = STRICT

    steps: int | None = Field(None, ge=1)
    """Built-in engine: run this many scheduler steps, then freeze the requests again (as `pause` with
    `keep`): every running request advances by exactly that many tokens (a newcomer's first step adds its
    prefill's token too). For tests and debugging: what a request holds at a given token, independent of
    when the caller's next call arrives. vLLM engines refuse it."""


class VllmResumeRequest(ResumeRequest):
    """Body of `POST /resume` at a vLLM front: vLLM cannot stop itself after a number of steps."""

    @model_validator(mode="after")
    def _no_steps(self) -> "VllmResumeRequest":
        if self.steps is not None:
            raise ValueError("steps: vLLM cannot stop itself after a number of steps (a built-in engine's "
                             "/resume can); resume without it")  # fmt: skip
        return self


class InitInfo(BaseModel):
    """`init_info` of `POST /init_weight_transfer_engine`: a broadcast group to join, or shared slots."""

    model_config = STRICT

    backend: Literal["gloo", "nccl", "ipc"] = "gloo"
    ipc: dict[str, Any] | None = None
    """The trainer's slot or parameter handles (`backend = "ipc"`)."""
    master_address: str | None = Field(None, min_length=1, max_length=255)
    master_port: int | None = Field(None, ge=1, le=65535)
    rank_offset: int | None = Field(None, ge=1)
    world_size: int | None = Field(None, ge=2)
    group_name: str = Field("refit/", min_length=1, max_length=255)
    timeout_s: float = Field(600.0, gt=0.0, le=86400.0)

    @model_validator(mode="after")
    def _complete(self) -> "InitInfo":
        if self.backend == "ipc":
            if self.ipc is None:
                raise ValueError("backend 'ipc' needs the trainer's handles in init_info.ipc")
            return self
        missing = [k for k in GROUP_FIELDS if getattr(self, k) is None]
        if missing:
            raise ValueError(f"init_info lacks {', '.join(missing)}")
        assert self.rank_offset is not None and self.world_size is not None
        if self.rank_offset >= self.world_size:
            raise ValueError(f"need rank_offset < world_size, got {self.rank_offset} and {self.world_size}")
        return self


class InitRequest(BaseModel):
    """Body of `POST /init_weight_transfer_engine` (vLLM's shape)."""

    model_config = STRICT

    init_info: InitInfo


class UpdateRequest(BaseModel):
    """Body of `POST /update_weights`; `update_info`'s fields are checked by the receiver before it loads."""

    model_config = STRICT

    update_info: dict[str, Any]


class BuiltinUpdateRequest(UpdateRequest):
    """The built-in engine's `POST /update_weights`, which may also carry the update's start and finish: a
    refit through shared memory then costs one round trip instead of three (vLLM's front refuses them)."""

    start: bool = False
    """Pause at a step boundary first, as `/start_weight_update` does."""
    finish_version: int | None = Field(None, ge=0)
    """Once loaded, make this the weight version and resume, as `/finish_weight_update` does."""


class FinishRequest(BaseModel):
    """Body of `POST /finish_weight_update`: the version the new weights get (default: the next)."""

    model_config = STRICT

    version: int | None = Field(None, ge=0)
    weight_version: int | None = Field(None, ge=0)

    @property
    def chosen(self) -> int | None:
        return self.version if self.version is not None else self.weight_version


class AdapterRequest(BaseModel):
    """Body of the vLLM front's `POST /molt_load_adapter`: a LoRA run's refit, the adapter of `version`
    as a PEFT directory at `path` (on a filesystem the engine's node reads)."""

    model_config = STRICT

    version: int = Field(ge=0)
    path: str = Field(min_length=1)


class RpcRequest(BaseModel):
    """Body of the vLLM front's `POST /collective_rpc` (the front then allows only the `molt_*` methods)."""

    model_config = ConfigDict(strict=True, extra="allow", frozen=True, allow_inf_nan=False)

    method: str = Field(min_length=1, max_length=128)
    args: list[Any] = Field(default_factory=list)
    timeout: float | None = Field(None, gt=0.0, le=2 * 86400.0)
    """Seconds vLLM waits for the workers: the refit timeout (at most a day) and an HTTP grace."""


NEUTRAL = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "n": 1}


class SamplingParams(BaseModel):
    """Sampling parameters of one request (a subset of vLLM's `SamplingParams`, same names)."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True, allow_inf_nan=False)

    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)
    """0 or -1 disables top-k (vLLM uses -1)."""
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    max_tokens: int | None = Field(16, ge=1)
    """None: up to `engines.max_model_len` (vLLM's meaning)."""
    stop_token_ids: list[int] = Field(default_factory=list)
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    ignore_eos: bool = False
    logprobs: int | None = Field(None, ge=-1)
    """The sampled token's log-prob is always returned; k > 0 adds the k most likely tokens of each
    step (`top_logprobs`), -1 the whole vocabulary."""
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    detokenize: bool = False
    skip_special_tokens: bool = True
    routed_experts_prompt_start: int = Field(0, ge=0)
    """With routing capture: leave out the routing of the first this many prompt tokens (known already)."""


class GenerateRequest(BaseModel):
    """Body of `POST /inference/v1/generate`."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True, allow_inf_nan=False)

    token_ids: list[int] = Field(min_length=1)
    sampling_params: SamplingParams = Field(default_factory=SamplingParams)
    request_id: str | None = None
    model: str | None = None
    stream: bool = False
    """Answer as server-sent events: each step's new tokens, then the whole answer (the builtin engine; the
    vLLM front passes vLLM's streamed answer on in the same events)."""
    output_mode: Literal["tokens"] = "tokens"
    mm: dict | None = None
    """Images of a vision-language prompt: `{"images": [data URIs], "spans": [[offset, length], ...]}`,
    checked against the model by `molt_hpc.engine.vision.row_images`."""
