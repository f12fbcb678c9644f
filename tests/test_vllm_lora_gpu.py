"""A LoRA run with vLLM engines on one GPU (`make test-gpu`): vLLM serves each version's adapter by name.

`molt-hpc run` of the tiny model with `[actor.lora]` and `engines.kind = "vllm"`, trainer and vLLM on GPU 0:
an adapter refit moves no weights between processes (the trainer writes a PEFT adapter directory, vLLM
loads it under a new name; `refit/vllm_lora.py`), so one GPU is enough. Judged as the CPU LoRA run is
(`tests/test_e2e_lora.py`): the reward rises far outside the noise, the rollout KL stays small (vLLM's
LoRA kernels against peft's forward), every step's version reaches the engine. Skipped without vLLM.
"""

import json
import statistics
import subprocess

from molt_hpc.log import read_metrics
from tests.conftest import BIN, ROOT, vllm_gpu_marks
from tests.test_e2e import quarters
from tests.test_e2e_lora import TARGETS
from tests.test_vllm_gpu import VLLM_SETS

pytestmark = vllm_gpu_marks()


def test_lora_run_with_vllm_on_one_gpu_learns(tmp_path) -> None:
    steps = 160
    sets = [
        *VLLM_SETS, f"run.root={tmp_path}", f"run.steps={steps}", "checkpoint.interval=80", "logging.progress=lines",
        "actor.lr=2e-3", "actor.lora.rank=16", "actor.lora.alpha=32.0", f"actor.lora.target_modules={TARGETS}",
    ]  # fmt: skip
    cmd = [str(BIN / "molt-hpc"), "run", "configs/tiny_cpu.toml"] + [a for s in sets for a in ("--set", s)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    run_dir = tmp_path / "tiny-cpu"
    actor = [r for r in read_metrics(run_dir / "metrics.jsonl", source="actor") if "step" in r]
    assert [r["step"] for r in actor] == list(range(1, steps + 1))
    first, last, stderr = quarters([r["reward"] for r in actor])
    assert last - first > 5 * stderr and last > first + 0.05, (first, last, stderr)
    assert statistics.median(r["kl_rollout"] for r in actor) < 0.05
    assert read_metrics(run_dir / "metrics.jsonl", source="launcher")[-1]["engine_versions"] == {"engine-0": steps}
    assert [p.name for p in (run_dir / "refit-adapters").iterdir()] == [f"v{steps:06d}"]  # older versions removed
    log = (run_dir / "logs" / "actor.log").read_text(errors="replace")
    assert "engines loaded the adapters" in log
    latest = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip() / "policy"
    assert json.loads((latest / "adapter_config.json").read_text())["r"] == 16
