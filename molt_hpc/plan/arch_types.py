"""What the plan knows of a model: `Arch` (shapes and exact parameter counts) and its per-block `Block`.

`molt_hpc.plan.arch` makes one from a meta-device build, `molt_hpc.plan.closed_form` from a config's fields.
"""

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Block:
    """Parameter counts of one decoder block."""

    params: int
    experts: int = 0
    """Routed-expert parameters (sharded over EP ranks under expert parallelism)."""
    router: int = 0
    """Router (gate) parameters: frozen by `actor.freeze_router`."""

    @property
    def moe(self) -> bool:
        return self.experts > 0


@dataclass(frozen=True)
class Arch:
    """What the plan needs of a model: shapes from its config, counts from its meta build."""

    model_type: str
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    tied: bool
    root_params: int
    """Parameters outside the decoder blocks: embeddings, final norm, LM head (once when tied)."""
    blocks: tuple[Block, ...]
    experts: int = 0
    top_k: int = 0
    moe_intermediate: int = 0
    shared_intermediate: int = 0
    """Width of the shared expert(s) of an MoE block (0: none)."""
    kv_lora_rank: int = 0
    """Multi-head latent attention (DeepSeek-V3 family): the compressed KV width; 0 for plain attention."""
    q_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    qk_norm: bool = False
    """Attention normalises q and k per head (Qwen3): two more RMSNorms per block."""
    fused_head: bool = False
    """The LM head is a bias-free linear layer applied as it is (no logit soft-capping or scaling), so the
    trainer computes log-probs from the last hidden states and the head weight, chunk by chunk, never
    the `[n, V]` logits (`molt_hpc.actor.head`). False: the model's own full logits."""
    source: str = ""
    extra: dict = field(default_factory=dict, compare=False)

    @property
    def params(self) -> int:
        return self.root_params + sum(b.params for b in self.blocks)

    @property
    def expert_params(self) -> int:
        return sum(b.experts for b in self.blocks)

    @property
    def router_params(self) -> int:
        return sum(b.router for b in self.blocks)

    @property
    def largest_block(self) -> Block:
        return max(self.blocks, key=lambda b: b.params)

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    def kv_bytes_per_token(self, tp: int, dtype_bytes: int) -> int:
        """KV-cache bytes one token takes on one GPU of an engine with tensor parallelism `tp`."""
        if self.mla:  # one latent vector per token and layer, replicated on every TP rank
            return self.layers * (self.kv_lora_rank + self.qk_rope_head_dim) * dtype_bytes
        return self.layers * 2 * max(1, self.kv_heads // tp) * self.head_dim * dtype_bytes
