"""The one typed config tree of a run, its loader and its TOML writer.

Sections live in small modules by side (model/data, trainer, engine pool, plumbing); `MoltConfig`
joins them and holds the rules that span sections.

- `base`: the base class every config section derives from (strict, documented, validated on assignment);
- `model`: what is trained on, the model and the dataset; `generator`: procedurally generated rows
  (`[data.generator]`, `[eval.generator]`);
- `train`: the trainer side (the RL algorithm, the actor pool, checkpoints); `stages`: the stages beyond RL
  (`[sft]`, `[rm]`, `[reward_model]`); `distill`: `[distill]`, on-policy distillation;
- `rollout`: the engine-pool side (rollout orchestration, inference engines, the router); `evaluation`: `[eval]`,
  held-out evaluation; `sandbox`: `[sandbox]`, the service that runs untrusted code for envs;
- `infra`: the run itself and its plumbing (run, buffer, refit, slurm, logging);
- `root`: `MoltConfig`, the root of the tree, and the rules that span sections; `exact`: the rules of
  `engines.exact`; `vllm_lora`: the rules of LoRA runs served by vLLM;
- `load`: TOML file + dotted `--set` overrides → a validated `MoltConfig`, or one `ConfigError`;
- `dump`: a config written back out as TOML; `reference`: the configuration reference as Markdown.
"""

from molt_hpc.config.dump import to_toml
from molt_hpc.config.load import ConfigError, apply_override, load_config
from molt_hpc.config.root import MoltConfig

__all__ = ["ConfigError", "MoltConfig", "apply_override", "load_config", "to_toml"]
