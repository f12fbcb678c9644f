"""Chat-mode runs through `molt-hpc run`: the trained samples carry the engine's log-probs, and chat mode
trains asynchronously with off-policy correction like env mode. Real processes throughout; expected values
come from the run's own records (metrics.jsonl)."""

import math
import subprocess
from pathlib import Path

import pytest

from molt_hpc.log import read_metrics
from tests.conftest import BIN, ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
pytest.importorskip("openai")  # the chat agents use ctx.openai


def run(tmp_path: Path, config: str, *sets: str) -> list[dict]:
    args = [a for s in (f"run.root={tmp_path}", "logging.progress=lines", *sets) for a in ("--set", s)]
    out = subprocess.run([str(BIN / "molt-hpc"), "run", config, *args], cwd=ROOT, capture_output=True, text=True,
                         timeout=540)  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    return read_metrics(run_dir / "metrics.jsonl", source="actor")


def test_a_chat_mode_run_trains_on_the_engines_logprobs_off_policy(tmp_path: Path) -> None:
    steps = 8
    actor = run(tmp_path, "configs/tiny_cpu.toml", f"run.steps={steps}", 'rollout.agent="envs/reverse_chat.py"')
    assert [r["step"] for r in actor] == list(range(1, steps + 1))
    # The trainer recomputes every token sampled under the weights it holds: the trace's log-probs are the
    # engine's for those tokens (a trace without them, or with others, would be far off or unmeasured).
    measured = [r for r in actor if "mismatch_tokens" in r]
    assert sum(r["mismatch_tokens"] for r in measured) > 0
    assert all(r["mismatch_abs_max"] < 1e-4 for r in measured), [r["mismatch_abs_max"] for r in measured]
    for r in actor:
        assert math.isfinite(r["kl_rollout"]) and r["kl_rollout"] >= 0.0
        if set(r["staleness"]) == {"0"}:  # every sample from the weights being trained: the engine agreed
            assert r["kl_rollout"] < 1e-8, r
        else:  # samples from older weights: the ratio is taken against the engine's log-probs, not recomputed
            assert r["kl_rollout"] > 1e-7, r
    assert max(int(k) for r in actor for k in r["staleness"]) <= 2  # buffer.max_staleness bounds it


def test_the_shipped_tool_calling_chat_config_runs(tmp_path: Path) -> None:
    actor = run(tmp_path, "configs/tiny_calculator_chat_cpu.toml", "run.steps=2")
    assert [r["step"] for r in actor] == [1, 2]
    assert all(r["mismatch_tokens"] > 0 and r["mismatch_abs_max"] < 1e-4 for r in actor if "mismatch_tokens" in r)
    assert actor[0]["tokens"] > actor[0]["action_tokens"] * 10  # the prompts carry the tools the template wrote
