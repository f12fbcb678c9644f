"""The whole RL loop on one machine through `molt-hpc run`: Ctrl-C, a killed trainer rank, a killed engine
and router, each resume, and the buffer's ledger across them.

Real processes throughout: the launcher, torchrun with the FSDP2 trainer, the engine pool (engine,
router, orchestrator), the replay buffer on disk. Expected values come from the run's own records
(metrics.jsonl, the buffer ledger, checkpoints), never from captured output.
"""

import json
import os
import signal
from pathlib import Path

import pytest

from molt_hpc.checkpoint import read_run_state
from molt_hpc.log import read_metrics
from tests.test_e2e import launch, ledger, wait_for_step

pytestmark = pytest.mark.slow


def test_interrupt_kill_and_resume_lose_nothing(tmp_path: Path) -> None:
    """Ctrl-C checkpoints and exits 0; a kill -9 of a trainer rank stops the run with a clear message;
    each resume continues from the last checkpoint; a killed engine is restarted; the ledger is exact.
    Where each fault lands depends on the machine's speed; every expectation is read from the run's
    own checkpoints and records at that point, never assumed from a timing."""
    run_dir = tmp_path / "tiny-cpu"
    # The periodic checkpoints are written behind the training: a kill lands while one is in flight too.
    proc = launch(tmp_path, "configs/tiny_cpu.toml", "--set", "run.steps=14", "--set", "checkpoint.interval=4",
                  "--set", "checkpoint.background=true")  # fmt: skip
    wait_for_step(run_dir, 2, proc)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    assert "stopped after a checkpoint" in out
    stopped_at = max(r["step"] for r in read_metrics(run_dir / "metrics.jsonl", source="actor"))
    assert 2 <= stopped_at < 14
    assert latest_step(run_dir) == stopped_at  # the stop checkpointed the step it stopped at
    _, acked, _ = ledger(run_dir)
    assert len(acked) == len(set(acked)) == stopped_at * 8
    acked_at_stop = set(acked)

    proc = launch(tmp_path, "--resume", str(run_dir))
    wait_for_step(run_dir, stopped_at + 1, proc)
    # One rank: the actor pool's process is the trainer rank itself (no torchrun agent above it).
    rank = json.loads((run_dir / "processes.json").read_text())["actor pool"]
    assert "jobs/actor.py" in Path(f"/proc/{rank}/cmdline").read_text()
    os.kill(rank, signal.SIGKILL)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1, out
    assert "actor pool exited with code" in out and "molt-hpc run --resume" in out
    killed_ckpt = latest_step(run_dir)
    ran_past_it = max(r["step"] for r in read_metrics(run_dir / "metrics.jsonl", source="actor"))
    assert ran_past_it < 14
    _, acked, _ = ledger(run_dir)
    # The kill can land between the last checkpoint's publication and its ack of the groups it covers
    # (the next start acks them from the checkpoint): the ledger holds every group up to the checkpoint
    # before, and of the last one's own groups at most those, never a group no checkpoint covers.
    covered = set(read_run_state(run_dir / "checkpoints" / f"step_{killed_ckpt:06d}")["trained_groups"])
    assert len(acked) == len(set(acked)) and acked_at_stop <= set(acked) <= acked_at_stop | covered
    assert len(acked_at_stop | covered) == killed_ckpt * 8

    proc = launch(tmp_path, "--resume", str(run_dir))
    wait_for_step(run_dir, ran_past_it + 1, proc)
    engine_pid = json.loads((run_dir / "rendezvous" / "engine-0.json").read_text())["pid"]
    os.kill(engine_pid, signal.SIGKILL)
    wait_for_step(run_dir, 11, proc)
    router_pid = json.loads((run_dir / "rendezvous" / "router.json").read_text())["pid"]
    os.kill(router_pid, signal.SIGKILL)  # requests in flight through it are lost: their samples are retried
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    pool_log = (run_dir / "logs" / "pool.log").read_text()
    assert "engine 0 died" in pool_log and "router died (exit -9); restarting it" in pool_log
    assert "died (exit 0)" not in pool_log  # clean stops are not deaths
    # The console of a resumed run: the resume point once, then only the new steps, each once.
    printed = [int(line.split()[1]) for line in out.splitlines() if line.startswith("step ")]
    assert printed == list(range(killed_ckpt + 1, 15)), out
    assert out.count(f"resuming from checkpoint step_{killed_ckpt:06d} (step {killed_ckpt} of 14)") == 1
    actor_log = (run_dir / "logs" / "actor.log").read_text()
    assert "resumed from" in actor_log and f"step_{killed_ckpt:06d}" in actor_log
    steps = [r["step"] for r in read_metrics(run_dir / "metrics.jsonl", source="actor")]
    assert steps[-1] == 14
    # Steps after the checkpoint the kill fell back to were redone once; every other step ran once.
    assert steps == list(range(1, ran_past_it + 1)) + list(range(killed_ckpt + 1, 15))
    put, acked, counts = ledger(run_dir)
    assert len(acked) == len(set(acked)) == 14 * 8, "a group was trained twice or lost from the ledger"
    assert set(acked) <= put
    leftover = put - set(acked)
    assert len(leftover) == counts["pending"] + counts["stale"] + counts["claimed"]


def latest_step(run_dir: Path) -> int:
    return int((run_dir / "checkpoints" / "latest").read_text().strip().removeprefix("step_"))
