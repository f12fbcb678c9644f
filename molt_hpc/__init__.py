"""molt-hpc: Slurm-native, Ray-free reinforcement learning for LLMs.

The package is a library of small parts (config, data, engines, router, buffer, actor, refit,
checkpoints, launchers); `molt_hpc.cli` routes the `molt-hpc` command to them. Importing the
package imports nothing heavy: torch and transformers load only in the modules that need them.

Packages: `config` (the one typed config tree of a run, its loader and its TOML writer), `datasets` (the
datasets of the stages beyond RL), `agents` (the user's environments and chat agents), `rollout` (the
rollout orchestrator process), `engine` (the built-in inference engine, and a `vllm serve` one), `router`
(the HTTP proxy that keeps each session on one engine), `protocol` (what every HTTP server of a run shares at
its edge), `scorer` (reward-model scorers and distillation teachers of the engine pool), `sandbox` (sandboxed
code execution for envs), `buffer` (the replay buffer, the only data path from rollout to training), `actor`
(the actor pool: the FSDP2 trainer of the policy), `algorithm` (the RL math, as pure tensor functions),
`parallel` (how a trainer's model is laid out over the actor pool's GPUs), `models` (model kinds and where
they come from), `vision` (images for vision-language models), `refit` (the weight refit from trainer rank 0
to every engine), `launch` (launchers: local mode and Slurm), `plan` (`molt-hpc plan`: does a config fit, on
paper, before anything runs).

Modules: `cli` (the `molt-hpc` command), `cli_engines` (`molt-hpc engines`: extra engine pools of a live run),
`cli_plan` (`molt-hpc plan`'s routes), `data` (the prompt dataset: rows, chat templating, length-balanced
order, a cursor), `readers` (the one row reader of every stage), `trajectory` (the data that flows from
rollout to training: `Trajectory`, `Group`), `checkpoint` (checkpoint directories on disk), `rundir` (the run
directory: its layout, its secret token, atomic file publication), `fault` (why a run stopped on its own),
`devices` (the GPUs this machine has, counted without importing torch), `net` (network helpers every process
kind shares), `log` (logging for every process and the `metrics.jsonl` writer), `hf_logging` (transformers'
own logging in our processes), `records` (reading a run's records as they grow, and their summaries),
`status` (`molt-hpc status RUN_DIR`: where a run is), `plot` (`molt-hpc plot RUN_DIR`: the run's curves as
one PNG), `trackers` (Weights & Biases and TensorBoard, fed with what `metrics.jsonl` gets), `sample` (one
sampled reply from the configured model, a quick check that it loads and generates).
"""

__version__ = "0.1.0"
