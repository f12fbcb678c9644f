"""Whether an expert-parallel degree fits the world and the model (torch-free: launchers call it too)."""

import json
from pathlib import Path

EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
"""Config fields naming the routed experts per MoE layer (Qwen / Mixtral / DeepSeek spellings)."""


def num_experts(config: dict) -> int | None:
    """Routed experts per MoE layer of an HF config dict (its `text_config` for a multimodal one);
    None for a dense model."""
    text = config.get("text_config") or config
    for key in EXPERT_KEYS:
        value = text.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return None


def model_experts(model_dir: str | Path) -> int | None:
    """Routed experts per MoE layer of the HF model in `model_dir` (None: dense, or no config.json)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return None
    return num_experts(json.loads(path.read_text()))


def check_ep(ep: int, world: int, ranks_per_node: int, experts: int | None) -> None:
    """Refuse an EP degree this world or model cannot take, saying what to change."""
    if ep == 1:
        return
    if experts is None:
        raise ValueError(f"actor.ep = {ep} but the model has no MoE experts: set actor.ep = 1 for a dense model")
    if experts % ep:
        raise ValueError(
            f"actor.ep = {ep} does not divide the model's {experts} experts per layer: pick an ep that divides "
            f"{experts}"
        )
    if world % ep:
        raise ValueError(
            f"actor.ep = {ep} does not divide the {world} trainer ranks (actor.ranks in local mode): pick an ep "
            f"that divides {world}"
        )
    if ranks_per_node % ep:
        raise ValueError(
            f"actor.ep = {ep} does not divide the {ranks_per_node} trainer ranks per node: expert parallelism stays "
            f"inside a node, so pick an ep that divides {ranks_per_node}"
        )
