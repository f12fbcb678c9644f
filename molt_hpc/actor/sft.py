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
from typing import Any

import torch
from torch import nn

from molt_hpc.actor import build
from molt_hpc.actor.batch import policy_logprobs
from molt_hpc.actor.packing import rank_micro_batches
from molt_hpc.actor.step import Meter
from molt_hpc.actor.world import World, sum_ranks
from molt_hpc.algorithm import Experience, global_token_count, make_experience
from molt_hpc.algorithm.supervised import sft_loss
from molt_hpc.config import MoltConfig
from molt_hpc.datasets import ReplyMarkers, SftDataset, SftSample
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
    part = "policy"
    loss_key = "sft_loss"

    def __init__(self, cfg: MoltConfig):
        assert cfg.sft is not None
        self.cfg, self.section = cfg, cfg.sft
        self.row_tokens = cfg.sft.max_tokens
        self.pack_tokens: int | None = None
        self.train_data: SftDataset | None = None
        self.eval_data: SftDataset | None = None
        self.pad_id = 0
        self.moe = None

    def expected_shapes(self, base: Path) -> dict[str, tuple[int, ...]]:
        return build.expected_shapes(base)

    def load_data(self, tokenizer: Any) -> tuple[SftDataset, SftDataset | None]:
        sec, markers = self.section, ReplyMarkers.probe(tokenizer)
        self.train_data = SftDataset.load(sec.data, sec, tokenizer, markers)
        if sec.eval_data:
            self.eval_data = SftDataset.load(sec.eval_data, sec, tokenizer, markers, limit=sec.eval_max_rows)
        return self.train_data, self.eval_data

    def _micro_batches(self, samples: list[SftSample], world: World):
        exp = sft_experience(samples, self.pad_id)
        rows = torch.arange(exp.sequences.shape[0])
        return exp, rank_micro_batches(exp, rows, self.cfg.actor.micro_batch_size, self.pack_tokens, world)

    def train(self, model: nn.Module, rows: list[int], world: World, meter: Meter) -> dict[str, float]:
        assert self.train_data is not None
        act = self.cfg.actor
        exp, mbs = self._micro_batches([self.train_data.samples[i] for i in rows], world)
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
    def evaluate(self, model: nn.Module, world: World) -> dict[str, float]:
        assert self.eval_data is not None
        _, mbs = self._micro_batches(self.eval_data.samples, world)
        total, count = 0.0, 0.0
        for mb in mbs:
            b = mb.batch.to(world.device)
            logp, _ = policy_logprobs(model, b, 1.0, self.cfg.actor.logprob_chunk, self.cfg.actor.logprob_kernel)
            if world.cp_rank == 0:
                total -= float(torch.where(b.action_mask, logp, 0.0).sum())
                count += float(b.action_mask.sum())
        total, count = sum_ranks([total, count])
        return {"eval_loss": total / max(count, 1.0)}
