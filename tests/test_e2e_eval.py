"""A tiny local run with `[eval]` (n > 1 samples at a temperature): pass@k records at version 0, every
`every` versions and at the end, `checkpoints/best` on an evaluated checkpoint, and the evaluation in
the step lines, `status` and the plot. Real processes throughout (`molt-hpc run`)."""

import itertools
import subprocess
from pathlib import Path

import pytest

from molt_hpc import checkpoint as ck
from molt_hpc.log import read_metrics
from molt_hpc.status import status_lines
from tests.conftest import BIN, ROOT

pytestmark = pytest.mark.slow
STEPS, EVERY, N, K = 6, 3, 4, [1, 2, 4]


def test_a_tiny_run_evaluates_pass_at_k_beside_training(tmp_path: Path) -> None:
    sets = [
        f"run.root={tmp_path}", f"run.steps={STEPS}", "checkpoint.interval=3", "checkpoint.keep_last=1",
        "logging.progress=lines", "eval.path=data/reverse_eval.jsonl", f"eval.n={N}", "eval.temperature=1.0",
        f"eval.k={K}", f"eval.every={EVERY}", "eval.max_prompts=8", "eval.best_metric=reward",
    ]  # fmt: skip
    args = [a for s in sets for a in ("--set", s)]
    out = subprocess.run([str(BIN / "molt-hpc"), "run", "configs/tiny_cpu.toml", *args], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    run_dir = tmp_path / "tiny-cpu"
    evals = read_metrics(run_dir / "metrics.jsonl", source="eval")
    versions = [r["eval_version"] for r in evals]
    assert versions[0] == 0 and versions[-1] == STEPS  # the first and the final version (after training)
    assert all(b // EVERY > a // EVERY for a, b in itertools.pairwise(versions))
    for r in evals:
        assert r["eval_prompts"] == 8 and r["eval_samples"] == 8 * N and r["eval_errors"] == 0
        passes = [r[f"eval_pass@{k}"] for k in K]
        assert all(0.0 <= p <= 1.0 for p in passes) and passes == sorted(passes)  # pass@k rises with k
        assert 0.0 <= r["eval_reward"] <= 1.0
    final = evals[-1]
    assert final["eval_version_min"] == final["eval_version_max"] == STEPS  # no refit after training
    # `best` names a whole checkpoint of the best of the evaluations that could be kept (one policy version,
    # checkpointed); the final one always could, and retention (keep_last = 1) kept what `best` names.
    best = ck.read_best(run_dir / "checkpoints")
    promoted = [r for r in evals if r.get("eval_best")]
    assert promoted and promoted[-1]["eval_reward"] == best["value"] and promoted[-1]["eval_version"] == best["version"]
    # `eval_best` is recorded where a whole checkpoint of the one version evaluated was there to compare
    assert "eval_best" not in evals[0], "version 0 has no checkpoint"
    eligible = [r["eval_reward"] for r in evals if "eval_best" in r]
    assert best["value"] == max(eligible) and best["metric"] == "reward"
    ck.verify(run_dir / "checkpoints" / best["checkpoint"])
    assert ck.read_run_state(run_dir / "checkpoints" / best["checkpoint"])["version"] == best["version"]
    # The console's step lines carry the last evaluation; status and the plot show the evaluations.
    assert any(" | eval v0 pass@1 " in line for line in out.stdout.splitlines() if line.startswith("step "))
    status = "\n".join(status_lines(run_dir))
    assert f"eval v{STEPS} pass@1" in status and f"best: {best['checkpoint']}" in status
    assert (run_dir / "plots" / "metrics.png").stat().st_size > 10_000
