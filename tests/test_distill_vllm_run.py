"""On-policy distillation through `molt-hpc run` with a vLLM-kind teacher (`distill.kind = "vllm"`) on the CPU:
the teacher process of the engine pool starts a stand-in `vllm serve` (`tests/vllm_teacher_standin.py`,
a real process computing prompt log-probs with the teacher model), asked for its top 2 tokens too, and
SIGKILLed mid-run.

Real processes throughout (the launcher, torchrun and the FSDP2 trainer, the engine pool with its router,
orchestrator and teacher, the replay buffer on disk). The groups the trainer claimed stay in the buffer
until the checkpoint that covers them (none before the stop here), so the test reads exactly what was
trained and checks every teacher log-prob against a teacher-forced forward of the teacher model.
"""

import json
import os
import signal
import subprocess

import pytest

from molt_hpc.buffer import find_spool
from molt_hpc.buffer.codec import decode_group
from molt_hpc.log import read_metrics
from tests.conftest import BIN, ROOT
from tests.test_distill import build_teacher, hf_logprobs, hf_top
from tests.test_distill_run import last_step, teacher_pid, wait_for
from tests.test_e2e import wait_for_step
from tests.vllm_teacher_standin import standin_site

pytestmark = pytest.mark.slow  # a whole `molt-hpc run` (about 40 s on 2 busy cores)

GROUPS_PER_STEP = 2


def standin_pids(records) -> list[int]:
    return [json.loads(p.read_text())["pid"] for p in sorted(records.glob("standin-*.json"), key=os.path.getmtime)]


@pytest.fixture(scope="module")
def distilled(tmp_path_factory):
    """The run, stopped (Ctrl-C) once steps past the stand-in's death trained; the groups claimed by then."""
    root = tmp_path_factory.mktemp("distill-vllm-run")
    teacher, site, records = build_teacher(root / "teacher"), standin_site(root / "site"), root / "records"
    records.mkdir()
    sets = [f"run.root={root}", "run.name=distill", "run.steps=60", f"distill.teacher={teacher}", "distill.kind=vllm",
            "rollout.temperature=1.0", "rollout.n_samples=4", "rollout.groups_in_flight=4",
            f"actor.groups_per_step={GROUPS_PER_STEP}", "checkpoint.interval=50", "logging.progress=lines",
            "engines.threads=1", "distill.top_k=2"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(site), "VLLM_STANDIN_DIR": str(records)}
    proc = subprocess.Popen([str(BIN / "molt-hpc"), "run", "configs/tiny_cpu.toml", "--no-plan",
                             *(a for s in sets for a in ("--set", s))], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)  # fmt: skip
    run_dir = root / "distill"
    try:
        wait_for_step(run_dir, 2, proc)
        first = teacher_pid(run_dir)
        (standin,) = standin_pids(records)
        os.kill(standin, signal.SIGKILL)  # `vllm serve` dies: its teacher process ends, the pool restarts it
        wait_for("a restarted teacher", lambda: p if (p := teacher_pid(run_dir)) not in (None, first) else None, proc)
        restarted_at = last_step(run_dir)
        wait_for_step(run_dir, restarted_at + 4, proc)
        spool = find_spool(run_dir)
        groups = [decode_group(f.read_bytes()) for f in sorted((spool / "claimed" / "trainer").iterdir())]
        trained = last_step(run_dir)
        pids = standin_pids(records)
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    return run_dir, teacher, groups, trained, restarted_at, pids


def test_trained_on_the_teachers_own_logprobs(distilled) -> None:
    """Every action token of every claimed group, the steps after the restart included, equals a teacher-forced
    forward of the teacher (vLLM's raw distribution: temperature 1), and each step's reverse KL is from them."""
    run_dir, teacher, groups, trained, restarted_at, _ = distilled
    assert len(groups) >= trained * GROUPS_PER_STEP
    assert max(g.min_version for g in groups) >= restarted_at, "groups rolled out after the restart were trained"
    samples = [s for g in groups for s in g.samples]
    want = hf_logprobs(teacher, [s.tokens for s in samples], [s.action_ranges for s in samples])
    for sample, w in zip(samples, want, strict=True):
        assert sample.teacher_logprobs == pytest.approx(w, abs=1e-5)
    tops = hf_top(teacher, [s.tokens for s in samples], [s.action_ranges for s in samples], 2)
    for sample, (ids, values) in zip(samples, tops, strict=True):  # vLLM's prompt_logprobs: 2, ranked 1..2
        assert sample.teacher_top_ids == ids
        assert [x for r in sample.teacher_top_logprobs for x in r] == pytest.approx(
            [x for r in values for x in r], abs=1e-5
        )
    steps = [r for r in read_metrics(run_dir / "metrics.jsonl", source="actor") if "step" in r]
    for r in steps[:trained]:
        batch = [s for g in groups[(r["step"] - 1) * GROUPS_PER_STEP : r["step"] * GROUPS_PER_STEP] for s in g.samples]
        diffs = [a - t for s in batch for a, t in zip(s.action_logprobs, s.teacher_logprobs, strict=True)]
        assert r["distill/reverse_kl"] == pytest.approx(sum(diffs) / len(diffs), abs=1e-6), r["step"]


def test_a_killed_vllm_is_restarted_and_groups_wait(distilled) -> None:
    """The teacher process ends with vLLM (exit 1), the pool restarts it with a fresh `vllm serve`; the groups
    finished meanwhile waited (the client retries) and reached the buffer with the teacher's log-probs."""
    run_dir, *_, pids = distilled
    assert len(pids) == 2 and pids[0] != pids[1]
    pool = (run_dir / "logs" / "pool.log").read_text()
    assert "teacher 0 died (exit 1); restarting it (1/" in pool
    assert "vLLM exited with -9 while serving" in (run_dir / "logs" / "teacher-0.log").read_text()
    rollout = (run_dir / "logs" / "rollout.log").read_text()
    assert "distillation teacher answers again after" in rollout, rollout[-2000:]
