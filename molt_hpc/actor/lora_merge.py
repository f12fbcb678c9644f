"""`molt-hpc model merge`: a LoRA checkpoint's adapters merged into their base, written as a plain HF model.

A LoRA run's checkpoint holds its policy as a PEFT adapter directory whose `adapter_config.json` names the
base (`base_model_name_or_path`). The merge is peft's own `merge_and_unload`, computed in fp32 and saved
in the base's dtype, with the base's tokenizer files: the result loads in transformers and vLLM as is.
"""

import json
from pathlib import Path

from molt_hpc import checkpoint as ck
from molt_hpc.actor.lora import CONFIG_FILE, WEIGHTS_FILE


def find_adapter(source: Path) -> Path:
    """The adapter directory `source` names: a run directory (its latest checkpoint), a checkpoint, or itself."""
    source = Path(source)
    if (source / CONFIG_FILE).is_file():
        return source
    if (source / "policy" / CONFIG_FILE).is_file():
        return source / "policy"
    latest = ck.latest_checkpoint(source / "checkpoints") if (source / "checkpoints").is_dir() else None
    if latest is not None and (latest / "policy" / CONFIG_FILE).is_file():
        return latest / "policy"
    what = f"its latest checkpoint {latest.name} holds a full model, not adapters" if latest else "no LoRA adapters"
    raise ValueError(
        f"{source}: {what}; give a LoRA run's directory, one of its checkpoints, or an adapter directory "
        f"({CONFIG_FILE} + {WEIGHTS_FILE})"
    )


def merge_adapter(source: Path, out: Path, base: Path | None = None) -> Path:
    """Write the model of `source`'s adapters merged into their base (or `base`) to `out`; returns `out`."""
    import torch
    from peft import PeftModel

    from molt_hpc.models.load import load_causal_lm

    adapter = find_adapter(source)
    if base is None:
        named = json.loads((adapter / CONFIG_FILE).read_text()).get("base_model_name_or_path")
        base = Path(named) if named else None
        if base is None or not (base / "config.json").is_file():
            raise ValueError(
                f"{adapter / CONFIG_FILE} names base model {named!r}, which is not a model directory here: "
                "pass --base BASE_DIR"
            )
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} exists and is not empty: give a new directory")
    model = load_causal_lm(base)  # fp32: the merge adds in full precision
    dtype = getattr(model.config, "dtype", None) or getattr(model.config, "torch_dtype", None) or torch.float32
    merged = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    merged.to(getattr(torch, dtype) if isinstance(dtype, str) else dtype).save_pretrained(str(out))
    ck.copy_tokenizer_files(base, out)
    return out
