"""A distillation teacher in the rollout (`[distill]`): each finished group is sent once to a teacher, which
scores every action token of every sample; the group reaches the buffer only with those log-probs.

One `/logprobs` request per group: the samples' token ids and action ranges (the prompt and env feedback
are context, never scored), at the rollout's temperature (the engines' log-probs of the student's tokens
are under the same). The answers go into each sample's `teacher_logprobs` (and, with `distill.top_k`, the
teacher's top tokens per action token into `teacher_top_ids` and `teacher_top_logprobs`), and the group's
`meta` records the action tokens scored (`teacher_tokens`) and the seconds the teacher's forwards took
(`teacher_s`), from which the trainer reports the teachers' rate. It runs in the group's own task, after a
reward model's scores: a group waits for a teacher (the client retries while none answers) while the others
go on; at a stop it is still in flight, and a restart issues it again. No group is ever put without the teacher's
log-probs.
"""

from typing import Any

from molt_hpc.log import get_logger
from molt_hpc.scorer.client import ScorerClient
from molt_hpc.trajectory import Group


class GroupTeacher:
    """Fills the teacher's log-probs of a group's action tokens."""

    def __init__(self, client: ScorerClient, temperature: float, top_k: int = 0):
        self.client, self.temperature, self.top_k = client, temperature, top_k

    async def teach(self, group: Group) -> None:
        samples = group.samples
        values, seconds = await self.client.logprobs(
            [s.tokens for s in samples], [s.action_ranges for s in samples], self.temperature, self.top_k
        )
        for sample, item in zip(samples, values, strict=True):
            sample.teacher_logprobs = [float(x) for x in item["logprobs"]]
            if self.top_k:
                sample.teacher_top_ids = [[int(i) for i in row] for row in item["top_ids"]]
                sample.teacher_top_logprobs = [[float(x) for x in row] for row in item["top_logprobs"]]
        group.meta["teacher_tokens"] = sum(len(v["logprobs"]) for v in values)
        group.meta["teacher_s"] = seconds


def group_teacher(cfg, run, http, token: str, tokenizer: Any, agent_cls: type) -> GroupTeacher | None:
    """The group teacher of `[distill]`, or None without one; checked before any rollout starts: an env-mode
    agent (chat mode records no log-probs of the student) and a teacher that reads the policy's token ids
    (the same vocabulary)."""
    dist = cfg.distill
    if dist is None:
        return None
    from molt_hpc.agents import ChatAgent
    from molt_hpc.models.load import load_tokenizer
    from molt_hpc.models.teacher import resolve_teacher, tokenizer_mismatch

    if issubclass(agent_cls, ChatAgent):
        raise ValueError(
            f"[distill] needs the student's log-prob of every sampled token, which a chat-mode agent "
            f"(rollout.agent = {cfg.rollout.agent!r}) does not record: write the agent as an Env"
        )
    path = resolve_teacher(cfg.model, dist.teacher, run.models)
    if (why := tokenizer_mismatch(load_tokenizer(path), tokenizer)) is not None:
        raise ValueError(f"distill.teacher = {dist.teacher!r}: {why}; name a teacher with the policy's tokenizer")
    get_logger().info("distilling from %s (%s): combine %s, weight %g", dist.teacher, path, dist.combine, dist.weight)
    return GroupTeacher(ScorerClient(http, run, token, dist, role="teacher"), cfg.rollout.temperature, dist.top_k)
