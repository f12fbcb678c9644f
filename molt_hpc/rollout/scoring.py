"""A reward model in the rollout: each finished group is scored once, before it is filtered and put.

The env's reward of every sample is kept in `info["env_reward"]`; the samples the model is asked
about (all, or under `combine = "gate"` the valid ones) are sent in one classify request, their raw
score kept in `info["rm_score"]`; then the trained `reward` is the combination
(`molt_hpc.algorithm.reward_model`). `score` stays the env's task score, so the reported task score
is never the model's opinion. Scoring runs in the group's own task: a group waits for a scorer while
the others go on; at a stop it is still in flight, and a restart issues it again.
"""

from molt_hpc.algorithm.reward_model import combine_reward, needs_score, normalised
from molt_hpc.config.stages import RewardModelConfig
from molt_hpc.scorer.client import ScorerClient
from molt_hpc.trajectory import Group


class GroupScorer:
    """Combines the env's rewards of a group with the reward model's scores."""

    def __init__(self, client: ScorerClient, cfg: RewardModelConfig, stats: tuple[float, float]):
        self.client, self.cfg = client, cfg
        self.mean, self.std = stats

    async def score_group(self, group: Group) -> None:
        cfg = self.cfg
        env = [s.reward for s in group.samples]
        asked = [i for i, e in enumerate(env) if needs_score(e, cfg.combine, cfg.gate_threshold)]
        scores = await self.client.score([group.samples[i].tokens for i in asked]) if asked else []
        z: list[float | None] = [None] * len(env)
        for i, score in zip(asked, scores, strict=True):
            group.samples[i].info["rm_score"] = score
            z[i] = normalised(score, self.mean, self.std)
        for sample, e, zi in zip(group.samples, env, z, strict=True):
            sample.info["env_reward"] = e
            sample.score = e if sample.score is None else sample.score
            sample.reward = combine_reward(e, zi, cfg.combine, cfg.weight, cfg.gate_threshold)
        group.meta["rm_scored"] = len(asked)
