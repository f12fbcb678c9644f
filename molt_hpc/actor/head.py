"""The last hidden states and the LM head weight of a forward, so the log-probs never see full logits.

`hidden_and_head(model, inputs)` runs the model's own forward (the FSDP root unit's hooks fire as
usual: the root's parameters — embeddings, final norm, LM head — are all-gathered and, by FSDP2's rule
for the root, stay unsharded after the forward) with `logits_to_keep=1`, so the LM head computes one
position per row instead of `[B, T, V]`. A forward hook on the decoder keeps its `last_hidden_state`
(after the final norm). The head's weight read after the forward is FSDP's unsharded parameter, so the
gradient the chunked log-probs return for it lands where FSDP reduce-scatters it from, tied embeddings
included (one parameter under two names).

A model qualifies when its LM head is a bias-free linear layer applied as it is (no logit soft-capping
or scaling): checked once per model on the one position the model's own head computed (its logits vs
the hidden state times the weight). Any other model, or one whose head is still sharded after the
forward, returns None and runs the full-logits path (`token_logprobs` from logits).
"""

import inspect
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from molt_hpc.log import get_logger

FUSED_OK = "_molt_fused_head"
"""Attribute caching the check on the model: True (qualifies), False (full logits)."""
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")
"""Config fields of transformers models whose head does more than the matmul (Gemma 2/3, Cohere, Granite)."""


class HeadInputs(NamedTuple):
    """What the chunked log-probs need from a forward, and the model's output (its other fields: MoE
    auxiliary losses, say; its logits are one position per row)."""

    hidden: Tensor
    weight: Tensor
    output: Any


def _head(model: nn.Module) -> nn.Module | None:
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if not isinstance(head, nn.Linear) or head.bias is not None:
        return None
    return head


def _decoder(model: nn.Module) -> nn.Module | None:
    get = getattr(model, "get_decoder", None)
    decoder = get() if callable(get) else None
    return decoder if isinstance(decoder, nn.Module) and decoder is not model else None


def qualifies_statically(model: nn.Module) -> bool:
    if _head(model) is None or _decoder(model) is None:
        return False
    config = getattr(model, "config", None)
    if any(getattr(config, name, None) not in (None, 1, 1.0) for name in LOGIT_TRANSFORMS):
        return False
    return "logits_to_keep" in inspect.signature(model.forward).parameters


def _last_hidden(output) -> Tensor:
    hidden = getattr(output, "last_hidden_state", None)
    return output[0] if hidden is None else hidden


def hidden_and_head(model: nn.Module, inputs: dict) -> HeadInputs | None:
    """(last hidden states `[B, S, H]`, LM head weight `[V, H]`) of `model(**inputs)`, or None when the
    model does not qualify (then nothing ran: the caller runs the full-logits forward)."""
    ok = getattr(model, FUSED_OK, None)
    if ok is False or (ok is None and not qualifies_statically(model)):
        setattr(model, FUSED_OK, False)
        return None
    captured: list[Tensor] = []
    hook = _decoder(model).register_forward_hook(lambda _m, _a, out: captured.append(_last_hidden(out)))
    try:
        out = model(**inputs, logits_to_keep=1)
    finally:
        hook.remove()
    head = _head(model)
    weight = head.weight
    if ok is None:
        ok = not isinstance(weight, DTensor) and len(captured) == 1 and _same_logits(out.logits, captured[0], weight)
        setattr(model, FUSED_OK, ok)
        if not ok:
            get_logger().info("%s: log-probs from full logits (its LM head is not a plain linear layer)",
                              type(model).__name__)  # fmt: skip
            return None
    return HeadInputs(captured[0], weight, out)


@torch.no_grad()
def _same_logits(logits: Tensor, hidden: Tensor, weight: Tensor) -> bool:
    """Whether the model's own last-position logits are `hidden @ weight.T` (to rounding)."""
    ref = logits[:, -1].float()
    mine = F.linear(hidden[:, -1].to(weight.dtype), weight).float()
    if ref.shape != mine.shape:
        return False
    # the same matmul in another shape may round differently: within about a bf16 unit
    return torch.allclose(mine, ref, rtol=2**-7, atol=2**-7 * float(ref.abs().mean()) + 1e-6)
