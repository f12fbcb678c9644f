"""On-policy distillation through `molt-hpc run` on the CPU: the tiny reverse task with a `[distill]` teacher
(the tiny model's spec at 4 layers and another seed) and its top tokens (`distill.top_k`), the teacher
killed mid-run.

Real processes throughout (the launcher, torchrun and the FSDP2 trainer, the engine pool with its router,
orchestrator and teacher, the replay buffer on disk). The groups the trainer claimed stay in the buffer
until the checkpoint that covers them (none before the stop here), so the test reads exactly what was
trained and checks every teacher log-prob against the teacher model's own forward, computed here.
"""

import json
import math
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from molt_hpc.buffer import find_spool
from molt_hpc.buffer.codec import decode_group
from molt_hpc.log import read_metrics
from tests.conftest import BIN, ROOT
from tests.test_distill import build_teacher, hf_logprobs, hf_top
from tests.test_e2e import wait_for_step

pytestmark = pytest.mark.slow  # a whole `molt-hpc run` (about 35 s on 2 busy cores)

TEMPERATURE = 0.8
GROUPS_PER_STEP = 2
TOP_K = 3


def teacher_pid(run_dir: Path) -> int | None:
    try:
        return json.loads((run_dir / "rendezvous" / "teacher-0.json").read_text())["pid"]
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def wait_for(what: str, ready, proc: subprocess.Popen, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (value := ready()) is not None:
            return value
        assert proc.poll() is None, f"run ended early:\n{proc.stdout.read()}"
        time.sleep(0.2)
    raise AssertionError(f"{what}: not within {timeout} s")


def last_step(run_dir: Path) -> int:
    return max((r["step"] for r in read_metrics(run_dir / "metrics.jsonl", source="actor") if "step" in r), default=0)


@pytest.fixture(scope="module")
def distilled(tmp_path_factory):
    """The run, stopped (Ctrl-C) once steps past the teacher's restart trained; the groups claimed by then."""
    root = tmp_path_factory.mktemp("distill-run")
    teacher = build_teacher(root / "teacher")
    sets = [f"run.root={root}", "run.name=distill", "run.steps=60", f"distill.teacher={teacher}",
            f"rollout.temperature={TEMPERATURE}", "rollout.n_samples=4", "rollout.groups_in_flight=4",
            f"actor.groups_per_step={GROUPS_PER_STEP}", "checkpoint.interval=50", "logging.progress=lines",
            "engines.threads=1", f"distill.top_k={TOP_K}", "distill.top_k_weight=0.5"]  # fmt: skip
    proc = subprocess.Popen([str(BIN / "molt-hpc"), "run", "configs/tiny_cpu.toml", "--no-plan",
                             *(a for s in sets for a in ("--set", s))], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    run_dir = root / "distill"
    try:
        wait_for_step(run_dir, 2, proc)
        first = teacher_pid(run_dir)
        os.kill(first, signal.SIGKILL)
        wait_for("a restarted teacher", lambda: p if (p := teacher_pid(run_dir)) not in (None, first) else None, proc)
        restarted_at = last_step(run_dir)
        wait_for_step(run_dir, restarted_at + 4, proc)
        spool = find_spool(run_dir)
        groups = [decode_group(f.read_bytes()) for f in sorted((spool / "claimed" / "trainer").iterdir())]
        trained = last_step(run_dir)
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    return run_dir, teacher, groups, trained, restarted_at, out


def test_trace_holds_the_teachers_own_logprobs(distilled) -> None:
    """Every action token of every claimed group (all trained ones, and any claimed for the next step)."""
    _, teacher, groups, trained, restarted_at, _ = distilled
    assert len(groups) >= trained * GROUPS_PER_STEP
    assert max(g.min_version for g in groups) >= restarted_at, "groups rolled out after the restart were trained"
    samples = [s for g in groups for s in g.samples]
    want = hf_logprobs(teacher, [s.tokens for s in samples], [s.action_ranges for s in samples], TEMPERATURE)
    for sample, w in zip(samples, want, strict=True):
        assert sample.teacher_logprobs == pytest.approx(w, abs=2e-5)
    tops = hf_top(teacher, [s.tokens for s in samples], [s.action_ranges for s in samples], TOP_K, TEMPERATURE)
    for sample, (ids, values) in zip(samples, tops, strict=True):
        assert sample.teacher_top_ids == ids
        assert [x for r in sample.teacher_top_logprobs for x in r] == pytest.approx(
            [x for r in values for x in r], abs=2e-5
        )
    for g in groups:
        assert g.meta["teacher_tokens"] == sum(s.num_action_tokens for s in g.samples) and g.meta["teacher_s"] > 0


def test_the_run_trains_on_the_reverse_kl(distilled) -> None:
    """Each step's `distill/reverse_kl` is the mean over its action tokens of engine - teacher log-prob, from
    the groups it trained: the claimed ones in put order (the trainer takes them first in, first out)."""
    run_dir, _, groups, trained, _, out = distilled
    steps = [r for r in read_metrics(run_dir / "metrics.jsonl", source="actor") if "step" in r]
    assert [r["step"] for r in steps][:trained] == list(range(1, trained + 1))
    for r in steps[:trained]:
        batch = [s for g in groups[(r["step"] - 1) * GROUPS_PER_STEP : r["step"] * GROUPS_PER_STEP] for s in g.samples]
        diffs = [a - t for s in batch for a, t in zip(s.action_logprobs, s.teacher_logprobs, strict=True)]
        assert r["distill/reverse_kl"] == pytest.approx(sum(diffs) / len(diffs), abs=1e-6), r["step"]
        assert math.isfinite(r["loss"]) and r["distill/teacher_tokens_per_s"] > 0
    assert "distill/reverse_kl" in out and "distill/topk_kl" in out


def test_the_first_step_trains_on_the_top_k_forward_kl(distilled) -> None:
    """Step 1's one update runs at the student's initial weights: its `distill/topk_kl` is the mean over its
    action tokens of the float64 forward KL from the teacher's top tokens (renormalised) to that student."""
    from transformers import AutoModelForCausalLM

    from molt_hpc.config import load_config
    from molt_hpc.models.resolve import resolve_model
    from tests.test_distill_topk import reference_kl

    run_dir, _, groups, _, _, _ = distilled
    student = resolve_model(load_config(ROOT / "configs" / "tiny_cpu.toml", []).model, run_dir / "models")
    model = AutoModelForCausalLM.from_pretrained(student, local_files_only=True).eval()
    kls = [x for g in groups[:GROUPS_PER_STEP] for s in g.samples for x in reference_kl(model, s, TEMPERATURE)]
    first = next(r for r in read_metrics(run_dir / "metrics.jsonl", source="actor") if r.get("step") == 1)
    assert first["distill/topk_kl"] == pytest.approx(sum(kls) / len(kls), abs=1e-4) and min(kls) > 0


def test_a_killed_teacher_is_restarted(distilled) -> None:
    """The pool restarts it like an engine; the groups trained after it (checked above) carry its log-probs."""
    run_dir, *_ = distilled
    pool = (run_dir / "logs" / "pool.log").read_text()
    assert "teacher 0 died (exit -9); restarting it (1/" in pool and "teacher 0 exit 0" in pool
