"""What one trainer rank processes, from the config: rows, tokens and micro-batches of one update, and the
settings of a step that change what it holds (`Shape`, made by `shape_of`)."""

import math
from dataclasses import dataclass

from molt_hpc.config import MoltConfig
from molt_hpc.plan.arch import Arch
from molt_hpc.plan.lora import adapter_params


@dataclass(frozen=True)
class Shape:
    """What one trainer rank processes, from the config."""

    ranks: int
    """FSDP world: every GPU of the actor pool."""
    cp: int
    ep: int
    rows: int
    """Rows in one micro-batch (fewer than `micro_batch_size` when a rank's share of an update is smaller)."""
    seq: int
    """Tokens per row: rows are padded to the longest in the batch, at most the longest row (`update_rows`)."""
    micro_batches: int
    """Micro-batches per optimizer update on one rank."""
    compute_bytes: int
    ac: bool
    chunk: int
    fused_head: bool
    """Log-probs from the last hidden states and the LM head weight (`Arch.fused_head`), never `[n, V]` logits."""
    entropy_grad: bool
    """The loss has an entropy bonus (`algorithm.entropy_coef > 0`): its gradient flows through the log-probs."""
    kv_repeat: bool
    """k and v repeated to every head (SDPA with a padded row's mask leaves its grouped-query path)."""
    fused_adam: bool
    offload: str
    reference: bool
    critic: bool
    freeze_router: bool
    eager_seq: int = 0
    """The row length when attention is `eager` (it keeps [heads, T, T] scores per row); 0 otherwise."""
    vocab_logits: bool = True
    """Whether the step computes log-probs over the vocabulary (a reward model's head has one output)."""
    lora_params: int = 0
    """Adapter parameters of a LoRA policy (`plan/lora.py`); 0: a full fine-tune."""

    @property
    def lora(self) -> bool:
        return self.lora_params > 0

    @property
    def tokens(self) -> int:
        """Tokens of one micro-batch on one rank (a CP rank holds 1/cp of each row)."""
        return self.rows * math.ceil(self.seq / self.cp)


def packs(cfg: MoltConfig) -> bool:
    """Whether the trainer packs rows (`molt_hpc.actor.packing`: `auto` packs what attention allows)."""
    return cfg.actor.packing == "on" or (cfg.actor.packing == "auto" and cfg.model.attn_implementation != "eager")


def update_rows(cfg: MoltConfig) -> tuple[int, int]:
    """(rows of one optimizer update over all ranks, tokens of the longest row): RL's groups × samples
    over its mini-batches, or a supervised stage's batch (SFT rows; reward-model pairs, both sides in one row)."""
    if cfg.run.stage != "rl":
        return getattr(cfg, cfg.run.stage).batch_size, cfg.longest_row[0]
    act, ro = cfg.actor, cfg.rollout
    return math.ceil(act.groups_per_step * ro.n_samples / act.mini_batches), ro.max_total_tokens


def shape_of(cfg: MoltConfig, ranks: int, device: str, arch: Arch) -> Shape:
    """One rank's micro-batch of `arch`: padded rows of the longest length, or one packed row filled to
    the token budget (every sample at full length: the worst case)."""
    act, rl = cfg.actor, cfg.run.stage == "rl"
    dp = max(1, ranks // act.cp)
    rows_per_update, longest = update_rows(cfg)
    mine = math.ceil(rows_per_update / dp)
    if packs(cfg):
        budget = act.max_tokens_per_micro_batch or act.micro_batch_size * longest
        rows, seq = 1, min(budget, mine * longest)
        micro = math.ceil(mine * longest / budget)
    else:
        rows, seq = min(act.micro_batch_size, mine), longest
        micro = math.ceil(mine / rows)
    return Shape(
        ranks=ranks, cp=act.cp, ep=act.ep, rows=rows, seq=seq,
        micro_batches=micro, compute_bytes=4 if cfg.model.dtype == "float32" else 2,
        ac=act.activation_checkpointing, chunk=act.logprob_chunk,
        fused_head=arch.fused_head, entropy_grad=rl and cfg.algorithm.entropy_coef > 0,
        # a padded row's mask sends SDPA's grouped-query attention through repeated k and v; packed
        # rows attend through the varlen kernel (or a sample at a time), without a mask
        kv_repeat=not packs(cfg) and cfg.model.attn_implementation != "flash_attention_2",
        fused_adam=device == "cuda",
        offload=act.offload, reference=rl and cfg.algorithm.uses_reference, critic=rl and cfg.algorithm.uses_critic,
        freeze_router=act.freeze_router,
        eager_seq=math.ceil(longest / act.cp) if cfg.model.attn_implementation == "eager" else 0,
        vocab_logits=cfg.run.stage != "rm",
        lora_params=adapter_params(arch, act.lora) if act.lora is not None and rl else 0,
    )  # fmt: skip
