"""The SFT stage of the trainer (`molt-hpc sft`): the policy learns the replies of chat demonstrations.

A demonstration is laid out like a rollout: its reply tokens are the "actions" of an `Experience`
(`action_mask` is the loss mask), so the RL trainer's micro-batching (packed or padded), document
attention, context parallelism and chunked log-probs run unchanged. The loss is the negative
log-likelihood of the reply tokens over the step's global supervised-token count
(`molt_hpc.algorithm.supervised.sft_loss`); `eval_loss` is the same mean over the held-out file.
The checkpoint's `policy` directory is an HF causal LM, a `model.path` for RL as it is.
"""

import contextlib
from pathlib import Path

import torch
from torch import nn

from molt_hpc.actor import build
from molt_hpc.actor.batch import policy_logprobs
from molt_hpc.actor.step import Meter
from molt_hpc.actor.world import World, sum_ranks
from molt_hpc.algorithm import Experience, global_token_count, make_experience
from molt_hpc.algorithm.supervised import sft_loss
from molt_hpc.config import MoltConfig
from molt_hpc.datasets import SftDataset, SftSample
from molt_hpc.trajectory import Trajectory


def sft_experience(samples: list[SftSample], pad_id: int) -> Experience:
    """Demonstrations as a batch whose actions are the reply tokens (one sample per row)."""
    trajs = []
    for i, s in enumerate(samples):
        n = sum(e - b for b, e in s.replies)
        trajs.append(Trajectory(tokens=s.token_ids, prompt_len=s.replies[0][0], action_ranges=list(s.replies),
                                action_logprobs=[0.0] * n, versions=[0] * n, group_id=str(i),
                                rollout_id=s.row_id))  # fmt: skip
    return make_experience(trajs, max_len=max(len(s.token_ids) for s in samples), pad_id=pad_id)


class SftStage:
    """What SFT adds to the supervised task: demonstrations as experience, the NLL of their replies."""

    part = "policy"
    loss_key = "sft_loss"
    dataset = SftDataset

    def __init__(self, cfg: MoltConfig):
        assert cfg.sft is not None
        self.cfg, self.section = cfg, cfg.sft
        self.row_tokens = cfg.sft.max_tokens
        self.moe = None

    def expected_shapes(self, base: Path) -> dict[str, tuple[int, ...]]:
        return build.expected_shapes(base)

    def rows(self, data: SftDataset) -> list[SftSample]:
        return data.samples

    def experience(self, rows: list[SftSample], pad_id: int) -> Experience:
        return sft_experience(rows, pad_id)

    def train(
        self, model: nn.Module, rows: list[SftSample], exp: Experience, mbs: list, world: World, meter: Meter
    ) -> dict[str, float]:
        act = self.cfg.actor
        count = global_token_count([mb.batch.action_mask for mb in mbs], group=world.dp_group)
        for mb in mbs:
            b = mb.batch.to(world.device)
            tokens = int(mb.batch.action_mask.sum())  # from the host copy: no device sync
            with self.moe.micro_batch(b) if self.moe else contextlib.nullcontext():
                logp, ent = policy_logprobs(model, b, 1.0, act.logprob_chunk, act.logprob_kernel)
                loss = sft_loss(logp, b.action_mask, count)
                if self.moe:  # MoE aux losses, weighted like the loss (a share of the global tokens)
                    loss = loss + self.moe.aux_loss(tokens / max(count, 1))
                (loss * world.dp_size).backward()
            entropy = torch.where(b.action_mask, ent.detach(), 0.0).sum() / max(1, tokens)
            meter.add({"loss": loss.detach(), "entropy": entropy}, tokens if world.cp_rank == 0 else 0)
        out = {"tokens": int(exp.attention_mask.sum()), "supervised_tokens": count, "rows": len(rows)}
        return {**out, **(self.moe.step_metrics(exp) if self.moe else {})}

    @torch.no_grad()
    def evaluate(self, model: nn.Module, rows: list[SftSample], mbs: list, world: World) -> dict[str, float]:
        total, count = 0.0, 0.0
        for mb in mbs:
            b = mb.batch.to(world.device)
            logp, _ = policy_logprobs(model, b, 1.0, self.cfg.actor.logprob_chunk, self.cfg.actor.logprob_kernel)
            if world.cp_rank == 0:
                total -= float(torch.where(b.action_mask, logp, 0.0).sum())
                count += float(b.action_mask.sum())
        total, count = sum_ranks([total, count])
        return {"eval_loss": total / max(count, 1.0)}
