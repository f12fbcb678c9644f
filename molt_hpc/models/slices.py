"""One rank's region of each model tensor, read straight from an HF directory's safetensors files.

A model tensor comes from the files either directly (same name, after the renames transformers
applies for the model type) or fused from several tensors: transformers 5 holds an MoE layer's
experts as one 3-D parameter (`mlp.experts.gate_up_proj`, `[E, 2I, H]`) while HF checkpoints hold
one 2-D tensor per expert and projection (`mlp.experts.3.gate_proj.weight`). The fusing rules are
the model type's `WeightConverter`s in transformers' conversion mapping, read here rather than
copied: stack the experts (`MergeModulelist(dim=0)`), then join the projections
(`Concatenate(dim=1)`). molt-hpc's own checkpoints are written from the live parameters, so they
hold the fused names and are read directly; both layouts load.

Only the region asked for is read: safetensors' `get_slice` copies just those bytes out of the
mapped file, so a rank holding 1/N of every tensor reads about 1/N of the checkpoint.
`Checkpoint.bytes_read` counts what was copied out.
"""

import re
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch

from molt_hpc.checkpoint import model_shapes

Region = tuple[tuple[int, int], ...]
"""(start, length) along each dimension of a tensor: the part this rank holds."""
DTYPE_BYTES = {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "BF16": 2, "F16": 2, "I16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
               "I8": 1, "U8": 1, "BOOL": 1}  # fmt: skip


@dataclass(frozen=True)
class Direct:
    """A model tensor stored under one checkpoint name."""

    name: str


@dataclass(frozen=True)
class Fused:
    """A model tensor stacked over experts (dim 0) from per-expert tensors, one list per projection,
    the projections joined along `cat_dim` of the fused tensor."""

    sources: tuple[tuple[str, ...], ...]
    cat_dim: int = 1


Recipe = Direct | Fused


def _conversions(*keys: str) -> tuple[list[tuple[str, str]], list[tuple[list[str], str, int]]]:
    """(renames as (regex, replacement), fusions as (source patterns, target, concat dim)) of the first of
    `keys` (a model class name, then its `model_type`: transformers looks up both, class first) that has any.

    Only the conversions this loader can slice by expert are taken; others leave their tensors to be
    found under their own names (or reported missing).
    """
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
        from transformers.core_model_loading import Concatenate, MergeModulelist, WeightConverter, WeightRenaming
    except ImportError:  # a transformers without conversion mappings stores what it runs
        return [], []
    renames, fusions = [], []
    mapping = next((m for k in keys if k and (m := get_checkpoint_conversion_mapping(k))), None)
    for conv in mapping or []:
        sources, targets = list(conv.source_patterns), list(conv.target_patterns)
        if isinstance(conv, WeightRenaming) and len(targets) == 1:
            renames += [(src, targets[0]) for src in sources]
        elif isinstance(conv, WeightConverter) and len(targets) == 1:
            ops = conv.operations
            stacked = bool(ops) and isinstance(ops[0], MergeModulelist) and ops[0].dim == 0
            if stacked and len(ops) == 1 and len(sources) == 1:
                fusions.append((sources, targets[0], 1))
            elif stacked and len(ops) == 2 and isinstance(ops[1], Concatenate):
                fusions.append((sources, targets[0], ops[1].dim))
    return renames, fusions


def _glob(pattern: str) -> re.Pattern:
    """A converter's source pattern (`*` stands for the expert index) as a regex capturing the index."""
    return re.compile(r"(\d+)".join(re.escape(part) for part in pattern.split("*")))


def recipes(ckpt_names: list[str], model_type: str, *class_names: str) -> dict[str, Recipe]:
    """Model tensor name → how to read it, from the checkpoint's tensor names (transformers' direction:
    checkpoint names are renamed and fused into model names). Qwen2-VL's legacy layout (`visual.*`,
    `model.layers.*`), which transformers also writes on save, is renamed by its class's mapping
    (`class_names`: the model's classes, most derived first)."""
    renames, fusions = _conversions(*class_names, model_type)
    direct: dict[str, Recipe] = {}
    parts: dict[tuple[str, int], dict[int, dict[int, str]]] = {}
    for key in ckpt_names:
        name = key
        for src, dst in renames:
            name = re.sub(src, dst, name)
        for sources, target, cat_dim in fusions:
            hit = next(((i, m) for i, s in enumerate(sources) if (m := _glob(s).search(name))), None)
            if hit is not None:
                i, m = hit
                fused = name[: m.start()] + target + name[m.end() :]
                parts.setdefault((fused, cat_dim), {}).setdefault(i, {})[int(m.group(1))] = key
                break
        else:
            direct[name] = Direct(key)
    for (fused, cat_dim), by_source in parts.items():
        experts = sorted(by_source[0])
        if sorted(by_source) != list(range(len(by_source))) or experts != list(range(len(experts))):
            raise ValueError(f"the checkpoint's experts of {fused} are incomplete (found {sorted(by_source[0])})")
        if any(sorted(ids) != experts for ids in by_source.values()):
            raise ValueError(f"the checkpoint's projections of {fused} have different expert counts")
        sources = tuple(tuple(by_source[i][e] for e in experts) for i in sorted(by_source))
        direct[fused] = Fused(sources, cat_dim)
    return direct


def _cut(t: torch.Tensor, region: Region) -> torch.Tensor:
    return t[tuple(slice(s, s + n) for s, n in region)]


class Checkpoint:
    """The safetensors files of an HF directory, opened once, read by region (a context manager)."""

    def __init__(self, model_dir: Path):
        self.dir = Path(model_dir)
        found = model_shapes(self.dir)  # every header checked against its file: a torn file is named here
        self.shapes = {name: shape for name, (shape, _) in found.items()}
        self._file = {name: f for name, (_, f) in found.items()}
        self._stack = ExitStack()
        self._open: dict[Path, object] = {}
        self.bytes_read = 0

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def _slice(self, name: str):
        from safetensors import safe_open

        path = self._file[name]
        if path not in self._open:
            self._open[path] = self._stack.enter_context(safe_open(str(path), framework="pt"))
        return self._open[path].get_slice(name)

    def nbytes(self, name: str) -> int:
        """Bytes of the whole tensor `name` in its file."""
        numel = 1
        for d in self.shapes[name]:
            numel *= d
        return numel * DTYPE_BYTES.get(self._slice(name).get_dtype(), 4)

    def read(self, name: str, region: Region) -> torch.Tensor:
        """The `region` of tensor `name`, copied out of its file (nothing else of the file is read)."""
        if any(n == 0 for _, n in region):
            return torch.empty([n for _, n in region])
        sl = self._slice(name)
        t = sl[tuple(slice(s, s + n) for s, n in region)] if region else self._open[self._file[name]].get_tensor(name)
        self.bytes_read += t.numel() * t.element_size()
        return t

    def shape_of(self, recipe: Recipe) -> tuple[int, ...]:
        """The shape of the model tensor `recipe` builds."""
        if isinstance(recipe, Direct):
            return tuple(self.shapes[recipe.name])
        first = [self.shapes[src[0]] for src in recipe.sources]
        joined = list(first[0])
        joined[recipe.cat_dim - 1] = sum(s[recipe.cat_dim - 1] for s in first)
        return (len(recipe.sources[0]), *joined)

    def total_bytes(self, recipe: Recipe) -> int:
        if isinstance(recipe, Direct):
            return self.nbytes(recipe.name)
        return sum(self.nbytes(n) for src in recipe.sources for n in src)

    def read_region(self, recipe: Recipe, region: Region) -> torch.Tensor:
        """The `region` of the model tensor `recipe` builds; a fused tensor reads only the experts in it."""
        if isinstance(recipe, Direct):
            return self.read(recipe.name, region)
        (e0, ne), rest = region[0], region[1:]
        experts = []
        for e in range(e0, e0 + ne):
            projections = [self.read(src[e], tuple((0, d) for d in self.shapes[src[e]])) for src in recipe.sources]
            experts.append(_cut(torch.cat(projections, dim=recipe.cat_dim - 1), rest))
        if not experts:
            return torch.empty([n for _, n in region])
        return torch.stack(experts)
