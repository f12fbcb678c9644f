"""The one typed config tree of a run, its loader and its TOML writer.

Sections live in small modules by side (model/data, trainer, engine pool, plumbing); `MoltConfig`
joins them and holds the rules that span sections.
"""

from molt_hpc.config.dump import to_toml
from molt_hpc.config.load import ConfigError, apply_override, load_config
from molt_hpc.config.root import MoltConfig

__all__ = ["ConfigError", "MoltConfig", "apply_override", "load_config", "to_toml"]
