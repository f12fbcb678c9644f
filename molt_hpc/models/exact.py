"""Batch-invariant forwards (`engines.exact`): a token's outputs are the same bits whatever batch it is in.

A plain forward is not: the CPU's matrix multiply picks its kernel by the number of rows (a one-row
decode step and a 1,000-row training forward reduce a dot product in different orders), attention
reduces over however many keys the batch holds, and a vectorised activation computes the tail of a
tensor with scalar code. `make_exact(model)` changes a plain transformers model in place, as a
function of the model (its modeling code is untouched; parameters, names and the state dict stay, so
refits and checkpoints work as before):

- every `nn.Linear` (the LM head included) becomes an `ExactLinear` (`models.exact_linear`): its rows are
  padded to a multiple of `ROWS` and multiplied in one matrix multiply, a shape whose per-row result the
  CPU's BLAS computes the same way wherever the row sits (checked at start by `linear_is_invariant`; where
  it does not hold, each element is an elementwise product summed by a strictly sequential `cumsum`);
- the MLP's activation computes every element with the same code (`ExactActivation`: torch's vector code
  in aligned calls where a check says that holds, else its scalar code on a strided view);
- attention is `models.exact_attention` (`molt_exact`; packed rows: `exact_documents`), as block matrix
  multiplies (`models.exact_blocks`) where this CPU's multiplies are row-invariant;
- a mixture-of-experts model's routers and experts get `models.exact_moe`'s forwards.

RMSNorm's mean over the hidden dimension, rotary embeddings' cos/sin, exp and log-softmax over the
last dimension compute each row the same way whatever the row count on the CPU, and are left as they
are there. On a CUDA GPU the multiplies are `models.exact_cuda`'s fixed-tile triton kernel and RMSNorm's
mean is added by it too (`models.exact_norm`); CUDA's log-softmax reduces a row by a layout chosen from the
row's length alone. The engine's sampling log-probs and the trainer's token log-probs then both come from
`exact_token_logprobs`' one function (`engine.sampling.processed_logprobs`) over these logits.
"""

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from molt_hpc.models import exact_attention
from molt_hpc.models.exact_linear import exact_linear
from molt_hpc.models.exact_norm import make_norms_exact

EXACT = "molt_exact"
"""Attribute set on a model `make_exact` changed."""


class ExactLinear(nn.Linear):
    """An `nn.Linear` (same parameters, same name) whose forward is `exact_linear`."""

    def forward(self, x: Tensor) -> Tensor:
        return exact_linear(x, self.weight, self.bias)


class ExactActivation(nn.Module):
    """An elementwise activation that computes every element with the same code wherever it sits.

    A contiguous tensor gets torch's vector code for its bulk and scalar code for its tail (and each
    thread's share has its own tail), whose results can differ in the last bit. Where the check
    `activation_is_invariant` passes, the input is cut into calls of `SPAN` elements (one thread each,
    under torch's parallel grain), every call starting at and spanning a multiple of `ALIGN`: every element
    then goes through the vector code. Elsewhere it runs on a strided view of its input, which torch
    computes with scalar code throughout."""

    def __init__(self, fn: nn.Module):
        super().__init__()
        self.fn = fn

    def forward(self, x: Tensor) -> Tensor:
        if x.is_cuda and activation_is_invariant(self.fn, x.dtype, x.device, plain_apply):
            return self.fn(x)  # a GPU's elementwise kernels run one code per element: no cutting needed
        if activation_is_invariant(self.fn, x.dtype, x.device):
            return aligned_apply(self.fn, x)
        return strided_apply(self.fn, x)


SPAN, ALIGN = 1 << 14, 64
"""Elements per call of `aligned_apply` (under torch's parallel grain of 32,768: one thread runs a call
from its start), and the multiple every call starts at and spans (no element left for the vector loop's
scalar tail: twice the widest vector of the narrowest dtype)."""
_ACTIVATIONS: dict[tuple, bool] = {}


def aligned_apply(fn: nn.Module, x: Tensor) -> Tensor:
    flat = x.reshape(-1)
    n = flat.numel()
    if n % ALIGN:
        flat = F.pad(flat, (0, (-n) % ALIGN))
    # `split`, not slices: its backward is one concatenation (a slice's allocates and fills the whole input)
    out = fn(flat) if flat.numel() <= SPAN else torch.cat([fn(part) for part in flat.split(SPAN)])
    return (out if out.numel() == n else out[:n]).view(x.shape)


def strided_apply(fn: nn.Module, x: Tensor) -> Tensor:
    spread = x.new_empty(*x.shape, 2)
    spread[..., 0] = x
    return fn(spread[..., 0])


def plain_apply(fn: nn.Module, x: Tensor) -> Tensor:
    return fn(x)


def activation_is_invariant(fn: nn.Module, dtype: torch.dtype, device: torch.device, apply=aligned_apply) -> bool:
    """Whether `apply` (`aligned_apply` by default) gives an element the same bits wherever it sits: alone,
    among rows of other counts and offsets, across a call boundary (cached per activation, dtype, device and
    form)."""
    key = (type(fn), dtype, str(device), apply.__name__)
    if key not in _ACTIVATIONS:
        gen = torch.Generator().manual_seed(0)
        x = (4 * torch.randn(3 * SPAN + 3 * ALIGN + 7, generator=gen)).to(device, dtype)
        full = apply(fn, x)
        cuts = [(0, 1), (5, 37), (ALIGN - 3, 2 * ALIGN + 1), (SPAN - 9, 3 * ALIGN), (SPAN + 1, 2 * SPAN + 11)]
        _ACTIVATIONS[key] = all(torch.equal(apply(fn, x[lo:hi]), full[lo:hi]) for lo, hi in cuts)
    return _ACTIVATIONS[key]


MOE_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")


def _check_modules(model: nn.Module, exact: set[int]) -> None:
    """Refuse a model with weights used outside `nn.Linear`, embeddings and the MoE modules in `exact`
    (ids of those already switched to exact forwards): convolutions, other expert layouts."""
    for name, mod in model.named_modules():
        if isinstance(mod, (nn.Linear, nn.Embedding)) or id(mod) in exact:
            continue
        for pname, p in mod.named_parameters(recurse=False):
            if p.dim() >= 2:
                raise ValueError(
                    f"engines.exact: {type(mod).__name__} ({name}.{pname}) multiplies by its weights outside "
                    "nn.Linear (MoE experts, convolutions), which has no batch-invariant form here: set "
                    "engines.exact = false for this model"
                )


@torch.no_grad()
def make_exact(model: nn.Module) -> nn.Module:
    """Switch `model` to batch-invariant forwards in place (see the module docstring); returns it."""
    if getattr(model, EXACT, False):
        return model
    if getattr(model.config, "vision_config", None) is not None:
        raise ValueError("engines.exact runs text models only: set engines.exact = false for this model")
    exact = set()
    if any(getattr(model.config.get_text_config(), f, None) for f in MOE_FIELDS):
        from molt_hpc.models.exact_moe import make_moe_exact

        exact = make_moe_exact(model)
    _check_modules(model, exact)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                child.__class__ = ExactLinear  # same object, parameters and hooks: only the forward changes
            elif name == "act_fn":
                setattr(parent, name, ExactActivation(child))
    make_norms_exact(model)
    exact_attention.register()
    model.config._attn_implementation = exact_attention.ATTENTION
    setattr(model, EXACT, True)
    return model


def is_exact(model: nn.Module) -> bool:
    return bool(getattr(model, EXACT, False))
