"""`[distill]`: on-policy distillation in `molt-hpc run`. The policy (the student) samples as in RL; a
frozen teacher scores each sampled token, and the per-token reverse KL is the learning signal.

For the action token `a_t` of a rollout, with the engine's log-prob as the student's, the distillation
advantage is `log p_teacher(a_t | context) - log p_student(a_t | context)` (the negative per-token
reverse KL, `molt_hpc.algorithm.distill`). Teacher processes of the engine pool compute the teacher's
log-probs, one request per finished group (`molt_hpc.scorer.teacher`).
"""

from typing import Literal

from pydantic import Field, PositiveFloat, PositiveInt

from molt_hpc.config.base import Section


class DistillConfig(Section):
    """On-policy distillation from a frozen teacher: teacher processes in the engine pool score every
    action token of each finished group once; the advantage is the per-token reverse KL (`replace`) or the
    env's advantage plus it (`add`)."""

    teacher: str
    """The teacher: an HF causal-LM directory, a `builtin:` model name (built from the `[model]` section's
    spec, so the student's own builtin is its starting point), or a run directory (its latest checkpoint's
    policy: a finished `molt-hpc run` or `molt-hpc sft`). It must share the policy's tokenizer (the same
    vocabulary and the same ids for the run's prompts): it scores the rollout's own token ids."""
    kind: Literal["builtin", "vllm"] = "builtin"
    """`builtin`: transformers in a molt-hpc process of the engine pool (CPU or GPU); `vllm`: `vllm serve` of
    the teacher behind a token-checking front that asks its completions route for the prompt log-probs of
    each sequence (GPUs, the `gpu` extra). vLLM's prompt log-probs are of the raw distribution, so this kind
    needs `rollout.temperature = 1`."""
    count: PositiveInt = 1
    """Teacher processes, on the engine pool's first node; groups are sent to them in turn."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Teacher device; `auto` picks CUDA when available. On a GPU it takes the first GPU of the engine pool
    after the engines' and the reward-model scorers' (or shares the last one when there is none left)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype the teacher runs in (its log-probs are computed in float32 from its hidden states)."""
    combine: Literal["replace", "add"] = "replace"
    """`replace`: the advantage of action token t is `teacher_t - student_t` alone (the env's reward is
    still recorded, never trained on); `add`: the env-based advantage (`algorithm.advantage`, whitened
    when `algorithm.whiten`) plus `weight · (teacher_t - student_t)`."""
    weight: PositiveFloat = 1.0
    """Weight of the distillation term in `add`."""
    whiten: bool = False
    """Whiten the distillation term over the step's action tokens, `(d - mean) / (std + eps)`, before it is
    used (`replace`) or added (`add`). Its mean is minus the reverse KL, below 0 wherever the student is
    not the teacher, so unwhitened it pushes down every sampled token at once; a constant baseline leaves
    the expected gradient as it is and removes that push (on the tiny reverse task it decided whether a fresh
    student learned at all in the demo's budget: `docs/distill.md`)."""
    max_batch: PositiveInt = 16
    """Most sequences in one forward of a teacher."""
    timeout_s: PositiveFloat = 60.0
    """HTTP timeout of one teacher request; a teacher that does not answer in time is tried again."""
    top_k: int = Field(0, ge=0, le=20)
    """Also train on the teacher's `top_k` most likely tokens at each action token's position (0: off; at
    most 20): the teacher answers them with its log-probs, the trace carries them, and the policy loss gains
    `top_k_weight ·` the per-token forward KL from the teacher (renormalised over those tokens) to the
    student, averaged over the action tokens (`molt_hpc.algorithm.distill.topk_forward_kl`)."""
    top_k_weight: PositiveFloat = 1.0
    """Weight of the top-k forward-KL term in the policy loss (with `top_k > 0`)."""
    gpu_memory_utilization: float = Field(0.2, gt=0.0, le=1.0)
    """Fraction of GPU memory a vLLM teacher may take."""
    extra_args: list[str] = Field(default_factory=list)
    """Extra command-line arguments for a vLLM teacher's `vllm serve`."""
