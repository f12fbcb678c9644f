"""Held-out evaluation pieces: the unbiased pass@k against an enumeration of subsets, the `[eval]` config
rules, and `checkpoints/best` (exact promotion, pins and pruning) on real checkpoint directories."""

import itertools
import json
import math
import statistics
from fractions import Fraction
from pathlib import Path

import pytest

from molt_hpc import checkpoint as ck
from molt_hpc.config import ConfigError, load_config
from molt_hpc.config.evaluation import EvalConfig
from molt_hpc.log import step_line
from molt_hpc.rollout.evaluation import pass_at_k, sampling
from molt_hpc.rundir import atomic_write


def enumerated_pass_at_k(n: int, c: int, k: int) -> Fraction:
    """The chance that a uniformly drawn k-subset of n samples (c of them passing) holds a passing one,
    counted subset by subset."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return Fraction(sum(any(samples[i] for i in s) for s in subsets), len(subsets))


@pytest.mark.parametrize("n", range(1, 9))
def test_pass_at_k_equals_the_subset_enumeration(n: int) -> None:
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(float(enumerated_pass_at_k(n, c, k)), abs=1e-12)


def test_pass_at_k_is_stable_where_the_binomials_are_huge() -> None:
    for n, c, k in [(1000, 3, 500), (2000, 1, 1), (2000, 1999, 7), (500, 0, 100), (300, 150, 150)]:
        exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
        assert pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-12, abs=1e-15)
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass@1 is the passing fraction


def test_eval_config_rules() -> None:
    with pytest.raises(ValueError, match=r"has k > eval\.n"):
        EvalConfig(path="x", n=4, k=[1, 8])
    with pytest.raises(ValueError, match="use one of"):
        EvalConfig(path="x", n=4, k=[1, 4], best_metric="pass@2")
    with pytest.raises(ValueError, match="needs one of `path`"):
        EvalConfig()
    ev = EvalConfig(path="x", n=8, k=[1, 8], temperature=0.7, top_p=0.9, best_metric="pass@8")
    assert ev.metric_key == "eval_pass@8"
    assert sampling(ev) == {"temperature": 0.7, "top_p": 0.9, "top_k": 0}
    assert sampling(EvalConfig(path="x")) == {"temperature": 0.0, "top_k": 1, "top_p": 1.0}  # greedy
    with pytest.raises(ConfigError, match=r"multiple of checkpoint.interval \(4\)"):
        load_config(None, ["eval.path=x", "eval.every=6", "checkpoint.interval=4", "eval.best_metric=reward"])


def test_the_step_line_shows_the_last_evaluation() -> None:
    line = step_line(7, {"reward": 0.5, "eval_version": 5, "eval_pass@1": 0.25, "eval_pass@4": 0.5,
                         "eval_reward": 0.375})  # fmt: skip
    assert line == "step 7 | reward 0.500 | eval v5 pass@1 0.250 pass@4 0.500 reward 0.375"


def fake_checkpoint(root: Path, step: int, publish: bool = True) -> Path:
    """A whole checkpoint directory of real files (the manifest hashes them), published like the trainer's."""
    tmp = ck.begin(root, step)
    ck.write_json(tmp / ck.RUN_STATE, {"step": step, "version": step})
    ck.write_manifest(tmp)
    return ck.publish(root, tmp, step, keep_last=2) if publish else tmp


def test_best_names_only_a_whole_checkpoint_of_the_evaluated_version(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    fake_checkpoint(root, 2)
    assert ck.promote_best(root, 3, "pass@1", 0.9) is None  # version 3 has no checkpoint: nothing compared
    assert ck.read_best(root) is None
    assert ck.promote_best(root, 2, "pass@1", 0.4)
    assert ck.best_checkpoint(root) == root / "step_000002"
    fake_checkpoint(root, 4)
    assert ck.promote_best(root, 4, "pass@1", 0.4) is False  # a tie keeps the earlier
    assert ck.promote_best(root, 4, "pass@1", 0.5)
    assert ck.read_best(root) == {"checkpoint": "step_000004", "version": 4, "metric": "pass@1", "value": 0.5}
    assert ck.promote_best(root, 2, "pass@1", 0.45) is False
    assert json.loads((root / ck.BEST).read_text())["checkpoint"] == "step_000004"


def test_pruning_keeps_the_best_and_the_pinned_checkpoints(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    fake_checkpoint(root, 1)
    assert ck.promote_best(root, 1, "reward", 0.7)
    ck.pin(root, 2)  # its evaluation starts before the checkpoint is written
    for step in range(2, 7):
        fake_checkpoint(root, step)
    kept = sorted(p.name for p in root.glob("step_*"))
    assert kept == ["step_000001", "step_000002", "step_000005", "step_000006"]
    assert ck.promote_best(root, 2, "reward", 0.9)  # unpins it and makes it best
    fake_checkpoint(root, 7)
    assert sorted(p.name for p in root.glob("step_*")) == ["step_000002", "step_000006", "step_000007"]
    assert ck.best_checkpoint(root) == root / "step_000002" and (root / "step_000002" / ck.MANIFEST).is_file()


def test_a_rerun_that_replaces_the_best_checkpoint_drops_best(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    fake_checkpoint(root, 1)
    fake_checkpoint(root, 2)
    assert ck.promote_best(root, 2, "pass@1", 0.5)
    atomic_write(root / ck.LATEST, "step_000001\n")  # a crash before `latest` moved on: step 2 is retrained
    fake_checkpoint(root, 2)
    assert ck.read_best(root) is None


def test_mean_of_pass_at_1_is_the_passing_fraction() -> None:
    counts = [(4, 0), (4, 1), (4, 4), (4, 2)]
    assert statistics.fmean(pass_at_k(n, c, 1) for n, c in counts) == pytest.approx(7 / 16)
