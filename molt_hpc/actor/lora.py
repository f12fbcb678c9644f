"""LoRA policies (`[actor.lora]`): peft's low-rank adapters over a frozen base, in the trainer.

The adapters are injected into the plain transformers model on the meta device (`models.lora.inject`,
peft's `inject_adapter_in_model`: no `PeftModel` wrapper, so the base keeps its HF module paths, with
`.base_layer` inserted in each adapted layer's), before FSDP2 shards it. The base is stored in
`model.dtype` and frozen (no fp32 master copy); the adapters are fp32 and are the only trained
parameters. The reference policy of the KL is the same model with its adapters switched off
(`adapters_disabled`): no second copy of the weights.

Names: a parameter `model.layers.0.self_attn.q_proj.lora_A.default.weight` travels (refit) as
`model.layers.0.self_attn.q_proj.lora_A.weight` and is saved (PEFT adapter directories:
`adapter_config.json` + `adapter_model.safetensors`, what `PeftModel.from_pretrained` and vLLM's
`--lora-modules` read) as `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`.
"""

import contextlib
import copy
import json
import math
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn

from molt_hpc.models.lora import ADAPTER, is_adapter, wire_name

PEFT_PREFIX = "base_model.model."
"""What `PeftModel` puts before the HF module path in its saved keys."""
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


def has_adapters(model: nn.Module) -> bool:
    return any(is_adapter(name) for name, _ in model.named_parameters())


def adapter_params(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(name, p) for name, p in model.named_parameters() if is_adapter(name)]


def scaling(model: nn.Module) -> float:
    """`alpha / rank` of the model's adapters (one value: every layer has the same rank and alpha)."""
    cfg = model.peft_config[ADAPTER]
    return float(cfg.lora_alpha) / float(cfg.r)


def fresh_value(seed: int) -> Callable[[str, tuple[int, ...]], torch.Tensor]:
    """Initial adapters as peft draws them (A: Kaiming-uniform with a = sqrt(5), i.e. U(±1/sqrt(in));
    B: zeros, so the policy starts as the base), from a generator seeded by `seed` and the name: the
    same values at any rank count."""

    def value(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if ".lora_B." in name:
            return torch.zeros(shape)
        gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(wire_name(name).encode()))
        bound = 1.0 / math.sqrt(shape[1])
        return torch.rand(shape, generator=gen) * (2 * bound) - bound

    return value


def read_adapter(adapter_dir: Path) -> dict[str, torch.Tensor]:
    """The tensors of a PEFT adapter directory, by wire name (`PEFT_PREFIX` removed)."""
    from safetensors.torch import load_file

    path = adapter_dir / WEIGHTS_FILE
    if not (adapter_dir / CONFIG_FILE).is_file() or not path.is_file():
        raise ValueError(
            f"{adapter_dir} is not a PEFT adapter directory ({CONFIG_FILE} + {WEIGHTS_FILE}): a checkpoint of a "
            "full fine-tune cannot resume with [actor.lora]; use a new run.name or drop [actor.lora]"
        )
    return {k.removeprefix(PEFT_PREFIX): v for k, v in load_file(str(path)).items()}


def saved_value(adapter_dir: Path) -> Callable[[str, tuple[int, ...]], torch.Tensor]:
    """Adapter values read from a PEFT adapter directory (a checkpoint's `policy`)."""
    tensors = read_adapter(adapter_dir)

    def value(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        t = tensors.get(wire_name(name))
        if t is None or tuple(t.shape) != shape:
            got = "missing" if t is None else f"of shape {list(t.shape)}"
            raise ValueError(
                f"{adapter_dir}: adapter tensor {wire_name(name)} is {got}, the configured [actor.lora] needs "
                f"{list(shape)}; resume with the rank and target_modules it was saved with"
            )
        return t.float()

    return value


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """The base model alone inside the block (the KL's reference policy); a no-op without adapters.
    Flips peft's per-layer switch only: `enable_adapters(False)` would also freeze the adapters."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    before = [m._disable_adapters for m in layers]
    for m in layers:
        m._disable_adapters = True
    try:
        yield
    finally:
        for m, b in zip(layers, before, strict=True):
            m._disable_adapters = b


def write_adapter(out: Path, tensors: dict[str, torch.Tensor], config, base: Path) -> None:
    """A PEFT adapter directory at `out`: `tensors` by wire name, `config` (peft's `LoraConfig`) naming `base`."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file({PEFT_PREFIX + k: v.contiguous() for k, v in tensors.items()}, str(out / WEIGHTS_FILE),
              metadata={"format": "pt"})  # fmt: skip
    config = copy.copy(config)
    config.base_model_name_or_path, config.inference_mode = str(base), True
    config.save_pretrained(str(out))
    assert json.loads((out / CONFIG_FILE).read_text())["r"] == config.r


def full_adapters(model: nn.Module, keep: bool, host: bool = True) -> dict[str, torch.Tensor]:
    """Every adapter tensor whole (gathered from the FSDP shards: a collective), by wire name; {} unless `keep`.
    `host`: copies in host memory (to write files); else where they live (a refit's sender packs them from
    there: a GPU's adapters do not go to the host and back)."""
    from molt_hpc.actor.weights import full_tensor

    out = {}
    for name, p in adapter_params(model):
        full, _ = full_tensor(p.detach())
        if keep:
            out[wire_name(name)] = full.detach().to("cpu", copy=True) if host else full.detach()
    return out


def save_adapter(world, model: nn.Module, out: Path, base: Path) -> None:
    """The LoRA policy `model` as a PEFT adapter directory at `out` over `base` (every rank calls; rank 0 writes)."""
    tensors = full_adapters(model, keep=world.is_main)
    if world.is_main:
        write_adapter(out, tensors, model.peft_config[ADAPTER], base)
