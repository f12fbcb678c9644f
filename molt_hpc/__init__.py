"""molt-hpc: Slurm-native, Ray-free reinforcement learning for LLMs.

The package is a library of small parts (config, data, engines, router, buffer, actor, refit,
checkpoints, launchers); `molt_hpc.cli` routes the `molt-hpc` command to them. Importing the
package imports nothing heavy: torch and transformers load only in the modules that need them.
"""

__version__ = "0.1.0"
