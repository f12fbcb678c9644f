"""The reward-model stage of the trainer (`molt-hpc rm train`): Bradley-Terry on preference pairs.

Each pair is one row holding its two sides as two documents (position ids restart; document
attention or transformers' own packed-row mask keeps them apart), so whatever way rows are cut into
micro-batches and dealt to ranks, both sides of a pair land in the same forward and the loss
`-log σ(r_chosen - r_rejected - margin)` (+ centering) is computed where its gradient is. A step's
loss is the sum over its pairs divided by its pair count. A side's score is the head's output at
its last token (`action_mask` marks it). Evaluation reports `eval_loss`, `eval_accuracy` (held-out
pairs whose chosen side scores higher) and `eval_margin`, and writes the mean and std of the
held-out scores into the model's config, so RL can normalise them (`reward_model.normalize`).
"""

from pathlib import Path

import torch
from torch import Tensor, nn

from molt_hpc.actor.step import Meter
from molt_hpc.actor.world import World, gather_all
from molt_hpc.algorithm import Experience
from molt_hpc.algorithm.supervised import bradley_terry, pair_accuracy
from molt_hpc.config import MoltConfig
from molt_hpc.datasets import Pair, PreferenceDataset
from molt_hpc.models.reward import MEAN_KEY, STD_KEY, token_scores
from molt_hpc.parallel.attention import attention_setup


def pair_experience(pairs: list[Pair], pad_id: int) -> Experience:
    """One row per pair: chosen (sample 2p) then rejected (2p+1), each side's last token its "action"."""
    b, t = len(pairs), max(p.length for p in pairs)
    seq = torch.full((b, t), pad_id, dtype=torch.long)
    pos = torch.zeros((b, t), dtype=torch.long)
    index = torch.full((b, t), -1, dtype=torch.long)
    last = torch.zeros((b, t), dtype=torch.bool)
    for r, p in enumerate(pairs):
        at = 0
        for side, ids in enumerate((p.chosen, p.rejected)):
            n = len(ids)
            seq[r, at : at + n] = torch.tensor(ids, dtype=torch.long)
            pos[r, at : at + n] = torch.arange(n)
            index[r, at : at + n] = 2 * r + side
            last[r, at + n - 1] = True
            at += n
        pos[r, at:] = torch.arange(t - at)  # the padding block restarts too, so it stays apart
    n = 2 * b
    return Experience(
        sequences=seq, attention_mask=index >= 0, position_ids=pos, seq_index=index, action_mask=last,
        action_log_probs=torch.zeros((b, t)), versions=torch.full((b, t), -1, dtype=torch.long),
        reward=torch.zeros(n), group_index=torch.arange(n) // 2, truncated=torch.zeros(n, dtype=torch.bool),
    )  # fmt: skip


def side_scores(model: nn.Module, mb: Experience) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(pair numbers `[p]`, chosen scores `[p]`, rejected scores `[p]`) of the pairs in a micro-batch,
    and the model's own (pooled) output, which the loss keeps in its graph."""
    setup = attention_setup(model)
    if setup is None:
        scores, out = token_scores(model, input_ids=mb.sequences, position_ids=mb.position_ids, use_cache=False)
    else:
        rows = setup.rows(mb)
        scores, out = token_scores(model, **rows.inputs)
        scores = (rows.cp.gather(scores) if rows.cp is not None else scores)[:, : mb.sequences.shape[1]]
    sample = mb.seq_index[mb.action_mask]
    at = scores[mb.action_mask]
    chosen, rejected = at[sample % 2 == 0], at[sample % 2 == 1]
    pairs = sample[sample % 2 == 0] // 2
    assert torch.equal(pairs, sample[sample % 2 == 1] // 2), "the two sides of a pair share a row"
    return pairs, chosen, rejected, out.logits


class RewardStage:
    """What reward-model training adds to the supervised task: pairs as rows, Bradley-Terry, pair metrics."""

    part = "reward"
    loss_key = "rm_loss"
    dataset = PreferenceDataset

    def __init__(self, cfg: MoltConfig):
        assert cfg.rm is not None
        self.cfg, self.section = cfg, cfg.rm
        self.row_tokens = 2 * cfg.rm.max_tokens
        self.moe = None  # a reward model's MoE routers (if any) run as transformers runs them

    def expected_shapes(self, base: Path) -> dict[str, tuple[int, ...]]:
        from transformers import AutoConfig, AutoModelForSequenceClassification

        config = AutoConfig.from_pretrained(str(base), local_files_only=True, num_labels=1)
        with torch.device("meta"):
            model = AutoModelForSequenceClassification.from_config(config)
        return {name: tuple(p.shape) for name, p in model.named_parameters()}

    def rows(self, data: PreferenceDataset) -> list[Pair]:
        return data.pairs

    def experience(self, rows: list[Pair], pad_id: int) -> Experience:
        return pair_experience(rows, pad_id)

    def train(
        self, model: nn.Module, pairs: list[Pair], exp: Experience, mbs: list, world: World, meter: Meter
    ) -> dict[str, float]:
        margins = torch.tensor([p.margin for p in pairs])
        for mb in mbs:
            b = mb.batch.to(world.device)
            index, chosen, rejected, pooled = side_scores(model, b)
            per_pair = bradley_terry(chosen, rejected, margins[index.cpu()].to(chosen.device), self.section.center_coef)
            # The pooled output joins the graph with weight 0 so FSDP's backward hooks on the model's output run.
            loss = per_pair.sum() / len(pairs) + 0.0 * pooled.sum()
            (loss * world.dp_size).backward()
            n = len(index) if world.cp_rank == 0 else 0
            if n:
                meter.add({"loss": loss.detach(), "rm_accuracy": pair_accuracy(chosen, rejected),
                           "rm_margin": (chosen - rejected).mean().detach()}, n)  # fmt: skip
        return {"tokens": int(exp.attention_mask.sum()), "pairs": len(pairs)}

    @torch.no_grad()
    def evaluate(self, model: nn.Module, pairs: list[Pair], mbs: list, world: World) -> dict[str, float]:
        mine: dict[int, tuple[float, float]] = {}
        for mb in mbs:
            index, chosen, rejected, _ = side_scores(model, mb.batch.to(world.device))
            if world.cp_rank == 0:
                mine.update(zip(index.tolist(), zip(chosen.tolist(), rejected.tolist(), strict=True), strict=True))
        scores = {k: v for part in gather_all(mine) for k, v in part.items()}
        assert len(scores) == len(pairs), "every held-out pair is scored once"
        c, r = (torch.tensor([scores[i][k] for i in range(len(pairs))]) for k in (0, 1))
        margins = torch.tensor([p.margin for p in pairs])
        both = torch.cat([c, r])
        mean, std = float(both.mean()), float(both.std()) if len(both) > 1 else 1.0
        setattr(model.config, MEAN_KEY, mean)  # saved with the next checkpoint: RL normalises with them
        setattr(model.config, STD_KEY, max(std, 1e-6))
        return {
            "eval_loss": float(bradley_terry(c, r, margins, self.section.center_coef).mean()),
            "eval_accuracy": float(pair_accuracy(c, r)),
            "eval_margin": float((c - r).mean()),
            "eval_score_mean": mean,
            "eval_score_std": std,
        }
