"""Pre-flight: what a run needs, checked before any process starts (`run`) or any job is queued.

checks.py  `preflight(cfg)`: paths made absolute, then the files, agent, model and data, cheapest first;
           `check_resume` before a run directory is resumed
data.py    a prompt file's first rows: keys, chat template, images, `data.max_prompt_tokens`
stages.py  a supervised stage's own files and rows; a `[reward_model]` against the policy
distill.py a `[distill]` teacher against the policy (a causal LM, the same tokenizer), an env-mode agent
model.py   a model directory the run loads (`model.path`, `distill.teacher`)
lora.py    `[actor.lora]`: peft is installed and the configured adapters fit the model
files.py   `PreflightError` (the one failure: the key, what is wrong, the fix) and the configured-file check
"""

from molt_hpc.launch.preflight.checks import check_resume, preflight
from molt_hpc.launch.preflight.files import PreflightError

__all__ = ["PreflightError", "check_resume", "preflight"]
