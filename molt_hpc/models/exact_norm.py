"""RMSNorm under `engines.exact` on a CUDA GPU: a row's mean of squares added in one fixed order.

torch's CUDA reduction chooses its thread layout by the number of rows it reduces (one row: 512 threads
share it; sixteen or more: 32 each), so a token's norm in a one-row decode step and in a training forward
differ in the last bit. `make_norms_exact(model)` switches the model's RMSNorm modules of the Llama form
(`weight * (x * rsqrt(mean(x²) + variance_epsilon)).to(dtype)`: Llama, Qwen2/3, Mistral, SmolLM2, their MoE
kinds) to the same formula with the mean's sum computed by `models.exact_cuda.rowsum` on CUDA; on the CPU
they run their own forward (the CPU's mean gives a row the same bits alone and among others). Any other
norm module with weights refuses to run on CUDA, with the fix.
"""

import torch
from torch import Tensor, nn

_CLASSES: dict[type, type] = {}


def _llama_form(mod: nn.Module) -> bool:
    weight = getattr(mod, "weight", None)
    return hasattr(mod, "variance_epsilon") and isinstance(weight, nn.Parameter) and weight.dim() == 1


def _exact_rms_forward(self, x: Tensor) -> Tensor:
    if not x.is_cuda:
        return self._plain_forward(x)
    from molt_hpc.models.exact_cuda import rowsum

    dtype = x.dtype
    h = x.to(torch.float32)
    variance = rowsum(h * h) / h.shape[-1]
    h = h * torch.rsqrt(variance + self.variance_epsilon)
    return self.weight * h.to(dtype)


def _refusing_forward(self, x: Tensor) -> Tensor:
    if x.is_cuda:
        raise ValueError(
            f"engines.exact on a GPU computes RMSNorm of the Llama form only; {self._plain_name} is "
            "another norm: run this model with engines.exact on the CPU, or set engines.exact = false"
        )
    return self._plain_forward(x)


def _subclass(cls: type, forward) -> type:
    if cls not in _CLASSES:
        # the plain forward by name, not super(): a wrapper that subclasses this class again (FSDP) keeps it
        body = {"forward": forward, "_plain_forward": cls.forward, "_plain_name": cls.__name__}
        _CLASSES[cls] = type(f"Exact{cls.__name__}", (cls,), body)
    return _CLASSES[cls]


def make_norms_exact(model: nn.Module) -> None:
    """Switch the model's norm modules in place (same objects and parameters: only the class changes)."""
    for mod in model.modules():
        cls = type(mod)
        if cls in _CLASSES.values() or "Norm" not in cls.__name__:
            continue
        if _llama_form(mod):
            mod.__class__ = _subclass(cls, _exact_rms_forward)
        elif any(p.dim() >= 1 for p in mod.parameters(recurse=False)):
            mod.__class__ = _subclass(cls, _refusing_forward)
