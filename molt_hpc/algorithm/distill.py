"""On-policy distillation (`[distill]`): the teacher's per-token signal as advantages (pure tensor functions).

The student (the policy) sampled action token `a_t`; the engine recorded its log-prob `log π_s(a_t | c_t)`
and a teacher scored it, `log π_t(a_t | c_t)`. Their difference is a one-sample estimate of the negative
reverse KL at that position, `-KL(π_s || π_t)(c_t)`, whose gradient through the policy loss moves the
student's distribution toward the teacher's where the student actually goes (mode seeking):

    distill_t = log π_t(a_t | c_t) - log π_s(a_t | c_t)        on action tokens, 0 elsewhere

`distill.combine = "replace"` trains on `distill_t` alone; `"add"` on the env-based advantage (from
`advantage.py`, whitened when configured) plus `weight · distill_t`. Nothing is discounted: each token's
signal is about that token (the teacher's verdict on the prefix it continues). `distill.whiten` whitens
`distill_t` over the step's action tokens first: its mean is minus the sampled reverse KL, negative while
the student differs from the teacher, and a constant baseline removes the push it gives every sampled token
without changing the expected gradient. Observation
tokens (prompt, env feedback) are never actions, so they never count, in the advantages or the metric.

With `distill.top_k`, `topk_forward_kl` is a loss term beside them: the per-token forward KL on the
teacher's top-k support, over every token the teacher finds likely rather than the sampled one; the
student's log-probs of those tokens come from `gathered_logprobs` in the policy's own forward.
"""

from typing import Literal

import torch
from torch import Tensor

from molt_hpc.algorithm.advantage import whiten
from molt_hpc.trajectory import Group


def reverse_kl_advantages(teacher: Tensor, student: Tensor, action_mask: Tensor) -> Tensor:
    """`[B, T]` `teacher - student` on action tokens, 0 elsewhere (in the inputs' dtype)."""
    diff = teacher.to(student.dtype) - student
    return torch.where(action_mask, diff, torch.zeros((), dtype=diff.dtype))


def distill_advantages(
    env: Tensor | None,
    teacher: Tensor,
    student: Tensor,
    action_mask: Tensor,
    combine: Literal["replace", "add"],
    weight: float = 1.0,
    whitened: bool = False,
    eps: float = 1e-6,
) -> Tensor:
    """The per-token advantages `[B, T]` of distillation: `d = teacher - student` (`replace`), or the
    env-based advantages `env` plus `weight · d` (`add`); 0 off the action tokens either way. With
    `whitened`, `d` is first whitened over the action tokens (`advantage.whiten`)."""
    distill = reverse_kl_advantages(teacher, student, action_mask)
    if whitened:
        distill = whiten(distill, action_mask, eps)
    if combine == "replace":
        return distill
    assert combine == "add", f"unknown combine {combine!r}"
    assert env is not None, "combine = 'add' needs the env-based advantages"
    out = env.to(distill.dtype) + weight * distill
    return torch.where(action_mask, out, torch.zeros((), dtype=out.dtype))


def topk_forward_kl(teacher_top: Tensor, student_top: Tensor, action_mask: Tensor) -> Tensor:
    """`[B, T]` forward KL on the teacher's top-k support at each action token, 0 elsewhere.

    `teacher_top [B, T, k]` holds the teacher's log-probs of its k most likely tokens at the position
    (a teacher's `top_logprobs`), `student_top [B, T, k]` the student's log-probs of the same tokens (its full
    distribution's). With `q = softmax(teacher_top)` over those k tokens (the teacher renormalised on its
    support): `sum_j q_j (log q_j - student_top_j)`. It is at least the KL from q to the student
    renormalised on the same tokens, so at least 0, and its gradient in the student is the cross-entropy's,
    `-sum_j q_j ∇ log p_s(j)`: every one of the teacher's likely tokens is pulled up, the sampled one or not
    (mode covering, where the sampled-token signal is mode seeking)."""
    q_log = torch.log_softmax(teacher_top.to(student_top.dtype), dim=-1)
    kl = (q_log.exp() * (q_log - student_top)).sum(dim=-1)
    return torch.where(action_mask, kl, torch.zeros((), dtype=kl.dtype))


def gathered_logprobs(source: Tensor, weight: Tensor | None, ids: Tensor, temperature: float, chunk: int) -> Tensor:
    """`[n, k]` log-probs of tokens `ids [n, k]` under `softmax(logits / temperature)` of each of `n` rows of
    `source` (last hidden states with the LM head `weight [V, H]`, or logits when it is None), in float32,
    differentiable. `chunk` rows at a time, each chunk checkpointed: its `[chunk, V]` logits are recomputed in
    the backward pass instead of kept, so no `[n, V]` tensor outlives its chunk."""
    from torch.utils.checkpoint import checkpoint

    def part(rows: Tensor, w: Tensor | None, picked: Tensor) -> Tensor:
        logits = rows if w is None else rows.to(w.dtype) @ w.t()
        return torch.log_softmax(logits.float() / temperature, dim=-1).gather(-1, picked)

    if source.shape[0] == 0:
        return torch.zeros(ids.shape, dtype=torch.float32, device=source.device)
    outs = [checkpoint(part, source[lo : lo + chunk], weight, ids[lo : lo + chunk], use_reentrant=False)
            for lo in range(0, source.shape[0], chunk)]  # fmt: skip
    return torch.cat(outs)


def reverse_kl(teacher: Tensor, student: Tensor, action_mask: Tensor) -> float:
    """Mean over the action tokens of `student - teacher` (the sampled estimate of KL(π_s || π_t)); 0 without any."""
    n = int(action_mask.sum())
    if n == 0:
        return 0.0
    return float((student.double() - teacher.double())[action_mask].sum()) / n


def teacher_rate(groups: list[Group]) -> float | None:
    """Action tokens the teachers scored per second of their forwards, over `groups` (their `meta` records
    `teacher_tokens` and `teacher_s`, written by the rollout); None when no group says."""
    tokens = sum(float(g.meta.get("teacher_tokens", 0)) for g in groups)
    seconds = sum(float(g.meta.get("teacher_s", 0.0)) for g in groups)
    return tokens / seconds if seconds > 0 else None
