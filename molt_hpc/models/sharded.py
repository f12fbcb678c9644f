"""Sharded loading: build a transformers model on the meta device, shard it, materialise only this
rank's shards and read only their bytes from the safetensors files.

    model = load_sharded(path, shard=lambda m: parallelize(m, mesh, ...), device=cuda)

1. The model is built from its `config.json` on the meta device (no memory, no weights).
2. `shard(model)` prepares it there (FSDP2's `fully_shard`, frozen parameters, ...): each
   parameter becomes a DTensor holding this rank's part.
3. `to_empty` allocates only those parts (on `device`; the host under CPU offload, with the
   buffers on `buffer_device`).
4. Non-persistent buffers (the rotary `inv_freq`), which no checkpoint holds, are recomputed by a
   fresh copy of their module built from the config on the CPU; a buffer this loader does not know
   how to rebuild is an error, never left as uninitialised memory.
5. Each tensor's region is read from the files (`molt_hpc.models.slices`): a rank of N reads about
   1/N of the checkpoint, and no rank ever holds the whole model.

Tied embeddings stay one parameter (FSDP2 shards it once in the root group; it is checked after
loading). Tensors the checkpoint lacks are an error unless `init_missing` names them (a critic's new
value head): those are drawn whole from a seeded generator and then cut, so their values do not
depend on the rank count.
"""

import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from molt_hpc.hf_logging import quiet_transformers
from molt_hpc.models.load import check_model_dir, lm_class
from molt_hpc.models.slices import Checkpoint, Region, recipes


@dataclass(frozen=True)
class LoadStats:
    """What this rank read: bytes copied out of the files, against the bytes of the whole model there."""

    bytes_read: int
    bytes_total: int

    @property
    def fraction(self) -> float:
        return self.bytes_read / max(1, self.bytes_total)


def meta_model(path: Path, *, critic: bool, dtype: torch.dtype, attn: str, reward: bool = False) -> nn.Module:
    """The model of `path/config.json` on the meta device: a causal LM (a vision-language model for a
    config with a vision tower), a one-label token classifier (`critic`), or a reward model (`reward`:
    a one-label sequence classifier, `molt_hpc.models.reward`)."""
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoModelForTokenClassification

    quiet_transformers()
    check_model_dir(path)
    config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    vision = getattr(config, "vision_config", None) is not None
    if critic and vision:
        raise ValueError(
            f"{path} is a vision-language model: a critic (algorithm.advantage = 'gae') needs a token classifier, "
            "which transformers does not build for it; use a critic-free advantage (grpo, rloo, ...)"
        )
    if reward and vision:
        raise ValueError(
            f"{path} is a vision-language model: a reward model needs a sequence classifier, which transformers "
            "does not build for it; train the reward model from a text model"
        )
    if critic or reward:
        config.num_labels = 1
    cls = AutoModelForTokenClassification if critic else lm_class(config)
    cls = AutoModelForSequenceClassification if reward else cls
    with torch.device("meta"):
        model = cls.from_config(config, dtype=dtype, attn_implementation=attn)
    if reward:
        from molt_hpc.models.reward import reward_config

        reward_config(model)
    return model


def is_tied(model: nn.Module) -> bool:
    out, inp = model.get_output_embeddings(), model.get_input_embeddings()
    return out is not None and inp is not None and out.weight is inp.weight


def local_region(t: torch.Tensor) -> Region:
    """(start, length) per dimension of the part of `t` this rank holds (all of a plain tensor)."""
    if not isinstance(t, DTensor):
        return tuple((0, d) for d in t.shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return tuple(zip(offset, shape, strict=True))


def rebuild_buffers(model: nn.Module) -> None:
    """Recompute every non-persistent buffer after `to_empty` (they hold uninitialised memory then)."""
    for prefix, module in model.named_modules():
        names = sorted(module._non_persistent_buffers_set)
        if not names:
            continue
        config = getattr(module, "config", None)
        if "RotaryEmbedding" not in type(module).__name__ or config is None:
            raise ValueError(
                f"{type(model).__name__}: buffer {prefix}.{names[0]} is not in the checkpoint and sharded loading "
                f"does not know how to rebuild a {type(module).__name__}; this model type is not supported yet"
            )
        with torch.device("cpu"):
            fresh = type(module)(config=config)  # rotary frequencies follow from the config alone
        with torch.no_grad():
            for name in names:
                getattr(module, name).copy_(getattr(fresh, name))


def head_init(seed: int, std: float) -> Callable[[str, tuple[int, ...]], torch.Tensor]:
    """Values of a new linear head's tensors, as transformers initialises one (weights normal with
    `std`, biases zero), from a generator seeded by `seed` and the tensor's name."""

    def init(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name.endswith(".bias"):
            return torch.zeros(shape)
        if not name.endswith(".weight") or len(shape) != 2:
            raise ValueError(
                f"the new head's tensor {name} {list(shape)} is not a linear layer's; cannot initialise it"
            )
        gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        return torch.randn(shape, generator=gen) * std

    return init


def _tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every tensor a checkpoint holds: parameters (a tied one once) and persistent buffers."""
    out = list(model.named_parameters())
    for prefix, module in model.named_modules():
        for name, buf in module.named_buffers(recurse=False):
            if buf is not None and name not in module._non_persistent_buffers_set:
                out.append((f"{prefix}.{name}" if prefix else name, buf))
    return out


def _lookup(name: str, table: dict, prefix: str):
    """`table[name]`, allowing for the base model's prefix (`model.`) on one side only."""
    for candidate in (name, name.removeprefix(prefix + "."), f"{prefix}.{name}"):
        if candidate in table:
            return table[candidate]
    return None


def load_local_shards(
    model: nn.Module,
    path: Path,
    *,
    init_missing: Callable | None = None,
    missing_ok: tuple[str, ...] = (),
    adapters: Callable | None = None,
) -> LoadStats:
    """Fill this rank's part of every tensor of `model` (materialised, sharded) from `path`'s files.

    `adapters` (a LoRA policy: `molt_hpc.actor.lora`) gives the whole value of each adapter tensor by
    name; the adapted layers' base tensors (`.base_layer.`) are read under their HF names."""
    prefix = getattr(model, "base_model_prefix", "model")
    with Checkpoint(path) as ckpt, torch.no_grad():
        classes = [c.__name__ for c in type(model).__mro__]  # FSDP2 subclasses the model's class
        table = recipes(list(ckpt.shapes), model.config.model_type, *classes)
        total = 0
        for name, t in _tensors(model):
            region = local_region(t)
            local = t.to_local() if isinstance(t, DTensor) else t
            if adapters is not None and (".lora_A." in name or ".lora_B." in name):
                local.copy_(adapters(name, tuple(t.shape))[tuple(slice(s, s + n) for s, n in region)])
                continue
            recipe = _lookup(name.replace(".base_layer.", "."), table, prefix)
            if recipe is None:
                if init_missing is None or not name.startswith(missing_ok):
                    raise ValueError(f"{path} has no tensor for {name}; is it a checkpoint of this model?")
                full = init_missing(name, tuple(t.shape))
                local.copy_(full[tuple(slice(s, s + n) for s, n in region)])
                continue
            if ckpt.shape_of(recipe) != tuple(t.shape):
                raise ValueError(
                    f"{path}: tensor {name} has shape {list(ckpt.shape_of(recipe))} in the checkpoint but "
                    f"{list(t.shape)} in the model; this checkpoint is from another model"
                )
            local.copy_(ckpt.read_region(recipe, region))
            total += ckpt.total_bytes(recipe)
        return LoadStats(ckpt.bytes_read, total)


def load_sharded(
    path: Path,
    *,
    shard: Callable[[nn.Module], object],
    device: torch.device,
    buffer_device: torch.device | None = None,
    dtype: torch.dtype = torch.float32,
    attn: str = "sdpa",
    critic: bool = False,
    seed: int = 0,
    reward: bool = False,
    adapters: Callable | None = None,
) -> tuple[nn.Module, LoadStats]:
    """The model in `path`, sharded by `shard` and materialised on `device`; (model, what this rank read).

    `critic`: a one-label token classifier on the same backbone; `reward`: a one-label sequence
    classifier. Their head (`score`), when the directory has none, is initialised from `seed` the same
    way at any rank count. `adapters`: see `load_local_shards`.
    """
    model = meta_model(path, critic=critic, dtype=dtype, attn=attn, reward=reward)
    tied = is_tied(model)
    shard(model)
    model.to_empty(device=device)
    if buffer_device is not None and buffer_device != device:
        for module in model.modules():
            for name, buf in module.named_buffers(recurse=False):
                if buf is not None:
                    module._buffers[name] = buf.to(buffer_device)
    rebuild_buffers(model)
    init, head = None, ()
    if critic or reward:  # the new head: the classifier's modules beside its backbone
        init = head_init(seed, model.config.initializer_range)
        head = tuple(f"{n}." for n, _ in model.named_children() if n != model.base_model_prefix)
    stats = load_local_shards(model, path, init_missing=init, missing_ok=head, adapters=adapters)
    assert is_tied(model) == tied, "sharding or materialising untied the embeddings"
    return model, stats
