"""Slurm jobs on a real local cluster, through `molt-hpc submit` / `sbatch` / `cancel`.

The driver's mechanics use stand-ins for the pools, `tests/slurm_standin_{actor,engine}.py` (set
through `slurm.actor_script` / `slurm.engine_script`): they keep the real entry points' contract
(control files, checkpoints, signals, exit codes) and log what happened to `RUN_DIR/standin/*.jsonl`,
which is what those tests check. The `test_real_pools_*` tests run the real entry points on the tiny
CPU config. Jobs that mostly wait (on slurmctld's 30 s tick, on training) are submitted together at
the module's start and run while the other tests do (`background_jobs`).
"""

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from molt_hpc.buffer.spool import acked_ids, find_spool
from molt_hpc.config import load_config
from molt_hpc.launch.slurm.state import slurm_job_state
from molt_hpc.log import read_metrics
from tests.conftest import ROOT, molt
from tests.slurm_support import (
    STANDINS,
    assert_each_step_once,
    driver_result,
    events,
    on_nodes,
    sets,
    standin_args,
    submit,
    trained_steps,
)

pytest_plugins = ["tests.slurm_cluster"]
pytestmark = pytest.mark.slurm

REAL_STEPS = 30  # the tiny config's reward rises within 30 steps (it doubles by 60)


@pytest.fixture(scope="module")
def background_jobs(slurm_cluster, tmp_path_factory, tiny_model_dir, request) -> dict[str, tuple[str, Path]]:
    """Submitted together when the first test that needs one starts, each on its own two nodes:
    - `time-limit`: stand-ins, a warning 50 s before the end of a 1-minute limit (it comes on
      slurmctld's first tick, 0-30 s after each start), so the job checkpoints and requeues over and over;
    - `preempted`: stand-ins, preempted by its test;
    - `real`: the real pools on the tiny config in partition `train`, preempted a third of the way in
      by a helper thread; only when a `test_real_pools_*` test is selected and the entry points exist.
    """
    root = tmp_path_factory.mktemp("background")
    jobs = {
        "time-limit": submit(root, tiny_model_dir, "time-limit", "run.steps=100000", "slurm.time=00:01:00",
                             "slurm.signal_lead_s=50", *on_nodes("node0", "node1")),
        # its first start holds after 5 steps until preempted, its second after 3 until requeued
        "preempted": submit(root, tiny_model_dir, "preempted", "run.steps=80", *on_nodes("node2", "node3"),
                            env={"MOLT_STANDIN_HOLD": "0:5,1:3"}),
    }  # fmt: skip
    wanted = any(item.name.startswith("test_real_pools") for item in request.session.items)
    if wanted and missing_entry_points() is None:
        jobs["real"] = submit_real(root)
        threading.Thread(target=preempt_real_run, args=(slurm_cluster, *jobs["real"]), daemon=True).start()
    return jobs


def test_preemption_checkpoints_requeues_and_resumes_to_the_end(slurm_cluster, background_jobs) -> None:
    """A preemption as this cluster sends it (the `--signal` at once, then TERM after GraceTime), then a
    requeue by Slurm itself, as `scontrol requeue` (or a preemption on clusters without
    `preempt_send_user_signal`) makes one: TERM to every process while Slurm requeues the job."""
    job, run = background_jobs["preempted"]
    wait_training(slurm_cluster, job, run, start=0, steps=5)
    _, engine_node = slurm_cluster.component_nodes(job)
    urgent = slurm_cluster.slurm("sbatch", "--parsable", "-p", "urgent", "-w", engine_node, "-c", "4",
                                 "-o", "/dev/null", "--wrap", "sleep 2").strip()  # fmt: skip
    wait_training(slurm_cluster, job, run, start=1, steps=3)
    slurm_cluster.slurm("scontrol", "requeue", job)
    assert slurm_cluster.wait_end(job, 120) == "COMPLETED"
    assert slurm_cluster.job_field(job, "Restarts") == "2"  # one requeue each: ours, then Slurm's own
    assert slurm_cluster.wait_end(urgent, 30) == "COMPLETED"
    log = (run / "logs" / "driver.log").read_text()
    assert "SIGUSR1: the actor pool checkpoints" in log
    assert "SIGTERM: the actor pool checkpoints at the next step boundary (a requeue by Slurm" in log
    assert log.count("requeued job") == 1 and "Slurm requeues job" in log
    assert [e["restart"] for e in events(run, "actor", "stopped")] == [0, 1]
    assert_each_step_once(run, 80)


def wait_training(cluster, job: str, run: Path, start: int, steps: int) -> None:
    """Until the job's start number `start` (0: the first) has trained `steps` steps."""

    def trained() -> bool:
        if cluster.job_states(job)[:1] == ["PENDING"]:
            cluster.kick(job)  # requeued: see LocalSlurm.kick
        return sum(1 for e in events(run, "actor", "step") if e["restart"] == start) >= steps

    cluster.wait_for(trained, 120, f"start {start} of job {job} to train {steps} steps", interval=0.5)


def test_het_job_runs_both_pools_and_ends_when_training_is_done(slurm_cluster, tmp_path, tiny_model_dir) -> None:
    job, run = submit(tmp_path, tiny_model_dir, "done", "run.steps=20", "actor.ranks=2")
    assert slurm_job_state(run) in (f"job {job} PENDING", f"job {job} RUNNING")
    dry = molt("submit", *standin_args(tmp_path, tiny_model_dir, "done", "run.steps=20", "actor.ranks=2"), "--dry-run")
    assert dry.stdout == (run / "submitit" / f"{job}_submission.sh").read_text()  # what sbatch got
    assert slurm_cluster.wait_end(job, 120) == "COMPLETED"
    assert slurm_job_state(run) == f"job {job} COMPLETED"
    assert driver_result(run, job) == {"status": "done", "engine_restarts": 0}

    actor_node, engine_node = slurm_cluster.component_nodes(job)
    assert actor_node != engine_node  # one node per het group
    starts = events(run, "actor", "start")
    assert sorted(s["rank"] for s in starts) == [0, 1]  # torchrun: actor.ranks processes on the node
    assert {s["env"]["WORLD_SIZE"] for s in starts} == {"2"}
    assert {s["env"]["SLURMD_NODENAME"] for s in starts} == {actor_node}
    assert_each_step_once(run, 20)
    [pool_start], [pool_stop] = events(run, "engine", "start"), events(run, "engine", "stop")
    [done] = events(run, "actor", "done")
    assert pool_start["node"] == engine_node
    assert pool_start["time"] < done["time"] < pool_stop["time"]  # served throughout, stopped after
    assert "CANCELLED" not in (run / "logs" / "pool.log").read_text()  # a clean stop reads as one

    again = molt("submit", *sets(f"run.root={tmp_path}", "run.name=done"))
    assert again.returncode == 2 and "already exists" in again.stderr and "--resume" in again.stderr


def status_of(run: Path) -> list[str]:
    result = molt("status", str(run))
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def test_a_failed_step_ends_the_job(slurm_cluster, tmp_path, tiny_model_dir) -> None:
    job_a, run_a = submit(tmp_path, tiny_model_dir, "actor-fails", "run.steps=1000",
                          env={"MOLT_STANDIN_ACTOR_FAIL_AT": "3"})  # fmt: skip
    job_b, run_b = submit(tmp_path, tiny_model_dir, "engines-fail", "run.steps=1000", "slurm.max_engine_restarts=1",
                          env={"MOLT_STANDIN_ENGINE_FAIL_AFTER": "4"})  # fmt: skip
    wrong = "data.path = 'x.jsonl': line 3: missing 'label' (stand-in)"
    job_c, run_c = submit(tmp_path, tiny_model_dir, "config-error", "run.steps=1000",
                          env={"MOLT_STANDIN_ENGINE_CONFIG_ERROR": wrong})  # fmt: skip
    assert slurm_cluster.wait_end(job_a, 90) == "FAILED"
    with pytest.raises(Exception, match="the actor pool step exited with code 1 before training finished"):
        driver_result(run_a, job_a)
    assert [e["step"] for e in events(run_a, "actor", "fail")] == [3]
    assert len(events(run_a, "engine", "stop")) == 1  # the engine pool was stopped, not left serving
    # The reason is in the driver's log and in `status`, not only in submitit's traceback.
    assert "job failed: the actor pool step exited with code 1" in (run_a / "logs" / "driver.log").read_text()
    lines = status_of(run_a)
    assert f"slurm: job {job_a} FAILED" in lines and any(
        line.startswith("job: restarts 0, nodes node") for line in lines
    )
    assert "job steps: none running" in lines
    [failed] = [line for line in lines if line.startswith("failed (driver, ")]
    assert "the actor pool step exited with code 1 before training finished" in failed
    assert not any(line.startswith("processes:") for line in lines)

    # A config error found at run time fails the job at once: the engine pool is not relaunched for it.
    assert slurm_cluster.wait_end(job_c, 90) == "FAILED"
    assert len(events(run_c, "engine", "start")) == 1 and len(events(run_c, "engine", "config error")) == 1
    [stopped] = events(run_c, "actor", "stopped")  # the actor pool checkpointed before the job ended
    assert events(run_c, "actor", "checkpoint")[-1]["step"] == stopped["step"]
    assert "failed (rollout, " in "\n".join(status_of(run_c)) and wrong in "\n".join(status_of(run_c))
    driver_log = (run_c / "logs" / "driver.log").read_text()
    assert f"job failed: run stopped: {wrong}" in driver_log and "relaunching" not in driver_log
    assert "--resume" not in driver_log  # resuming with the same config would fail the same way

    assert slurm_cluster.wait_end(job_b, 90) == "FAILED"
    with pytest.raises(Exception, match="the engine pool died 2 times"):
        driver_result(run_b, job_b)
    assert len(events(run_b, "engine", "start")) == 2  # relaunched once, then given up
    [stopped] = events(run_b, "actor", "stopped")  # the actor pool checkpointed before the job ended
    assert stopped["why"] == "control/stop"
    assert events(run_b, "actor", "checkpoint")[-1]["step"] == trained_steps(run_b)[-1]


def test_dead_engine_pool_is_relaunched_while_the_actor_pool_keeps_its_state(
    slurm_cluster, tmp_path, tiny_model_dir
) -> None:
    job, run = submit(tmp_path, tiny_model_dir, "relaunch", "run.steps=40")
    slurm_cluster.wait_for(lambda: len(trained_steps(run)) >= 3, 90, "the actor pool to train")
    [first] = events(run, "engine", "start")
    os.kill(first["pid"], signal.SIGKILL)  # the pool's process on its node dies
    assert slurm_cluster.wait_end(job, 90) == "COMPLETED"
    assert driver_result(run, job) == {"status": "done", "engine_restarts": 1}
    starts = events(run, "engine", "start")
    assert len(starts) == 2 and starts[0]["step_id"] != starts[1]["step_id"]  # a new step ...
    assert slurm_cluster.job_field(job, "Restarts") == "0"  # ... in the same allocation
    assert len(events(run, "actor", "start")) == 1  # the actor pool was never restarted
    assert_each_step_once(run, 40)


def test_cancel_checkpoints_first_unless_now(slurm_cluster, tmp_path, tiny_model_dir) -> None:
    job, run = submit(tmp_path, tiny_model_dir, "cancel", "run.steps=100000")
    job_now, run_now = submit(tmp_path, tiny_model_dir, "cancel-now", "run.steps=100000")
    job_sc, run_sc = submit(tmp_path, tiny_model_dir, "scancel", "run.steps=100000")
    for r in (run, run_now, run_sc):
        slurm_cluster.wait_for(lambda r=r: len(trained_steps(r)) >= 3, 90, "the actor pool to train")

    # `status` of a running Slurm job: its state, nodes and job steps.
    lines = status_of(run)
    actor_node, engine_node = slurm_cluster.component_nodes(job)
    assert f"slurm: job {job} RUNNING" in lines
    assert f"job: restarts 0, nodes {actor_node} + {engine_node} (het groups 0 + 1)" in lines
    [steps] = [line for line in lines if line.startswith("job steps: ")]
    assert f"molt-actor-pool on {actor_node}" in steps and f"molt-engine-pool on {engine_node}" in steps

    # A plain `scancel` ends the run: the actor pool checkpoints within KillWait, nothing is requeued.
    slurm_cluster.slurm("scancel", job_sc)
    assert slurm_cluster.wait_end(job_sc, 60) == "CANCELLED"
    assert slurm_cluster.job_field(job_sc, "Restarts") == "0"
    log = (run_sc / "logs" / "driver.log").read_text()
    assert "SIGTERM: the actor pool checkpoints at the next step boundary (`scancel`)" in log
    assert "not requeued" in log and "requeued job" not in log
    [stopped] = events(run_sc, "actor", "stopped")
    assert stopped["why"] == "SIGTERM" and events(run_sc, "actor", "checkpoint")[-1]["step"] == stopped["step"]
    assert trained_steps(run_sc)[-1] == stopped["step"]
    assert driver_result(run_sc, job_sc) == {"status": "cancelled"}

    busy = molt("submit", "--resume", str(run))
    assert busy.returncode == 2 and f"job {job} of {run} is still RUNNING" in busy.stderr
    now = molt("cancel", str(run_now), "--now")
    assert now.returncode == 0 and f"cancelled job {job_now} (at once)" in now.stdout, now.stderr
    clean = molt("cancel", str(run))
    assert clean.returncode == 0 and f"job {job} ended after its checkpoint (CANCELLED)" in clean.stdout, clean.stderr
    assert driver_result(run, job) == {"status": "cancelled"}
    assert "control/cancel: the actor pool checkpoints" in (run / "logs" / "driver.log").read_text()
    [stopped] = events(run, "actor", "stopped")
    assert stopped["why"] == "control/stop" and events(run, "actor", "checkpoint")[-1]["step"] == stopped["step"]
    assert trained_steps(run)[-1] == stopped["step"]

    assert slurm_cluster.wait_end(job_now, 30) == "CANCELLED"  # --now: Slurm's TERM reached every process
    assert not (run_now / "logs" / "driver.log").read_text().count("requeued job")
    for r in (run_now, run_sc):  # torchrun left the TERM to its ranks: no SignalException, no exit 1
        actor_log = (r / "logs" / "actor.log").read_text()
        assert "Traceback" not in actor_log and "SignalException" not in actor_log, actor_log
        assert "the actor pool stopped (exit 0) after its checkpoint" in (r / "logs" / "driver.log").read_text()
    again = molt("cancel", str(run))
    assert again.returncode == 2 and f"job {job} of {run} is not active (CANCELLED)" in again.stderr


def test_submission_problems_leave_no_run_directory(slurm_cluster, tmp_path, tiny_model_dir) -> None:
    base = sets(f"run.root={tmp_path}", f"model.path={tiny_model_dir}")
    gpus = molt("submit", *base, *sets("slurm.engines.gpus_per_node=4"))
    assert gpus.returncode == 2
    assert "slurm.engines.gpus_per_node = 4 but the nodes of partition 'debug' have at most 0 GPUs" in gpus.stderr
    refused = molt("submit", *base, *sets("slurm.engines.constraint=nvlink"))
    assert refused.returncode == 2
    assert "Slurm refused the job" in refused.stderr and "Invalid feature specification" in refused.stderr
    missing = molt("submit", *base, *sets("model.path=/nonexistent/model"))
    assert (
        missing.returncode == 2 and "model.path = '/nonexistent/model': /nonexistent/model does not" in missing.stderr
    )
    assert list(tmp_path.iterdir()) == []


def test_submit_from_another_directory_resolves_paths_before_queueing(slurm_cluster, tmp_path, tiny_model_dir) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    config = str(ROOT / "configs" / "tiny_cpu.toml")
    args = standin_args(tmp_path, tiny_model_dir, "from-elsewhere", "run.steps=5")
    queued = slurm_cluster.slurm("squeue", "-h", "-o", "%i")
    refused = molt("submit", config, *args, cwd=elsewhere)
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert (
        f"data.path = 'data/reverse_train.jsonl': {elsewhere}/data/reverse_train.jsonl does not exist (relative "
        f"paths are taken from the working directory, {elsewhere})" in refused.stderr
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere"]  # no run directory
    assert slurm_cluster.slurm("squeue", "-h", "-o", "%i") == queued  # nothing was queued

    shutil.copytree(ROOT / "data", elsewhere / "data")  # the user's own data and env, next to where they work
    shutil.copytree(ROOT / "envs", elsewhere / "envs")
    result = molt("submit", config, *args, cwd=elsewhere)
    assert result.returncode == 0, result.stderr
    job = re.search(r"submitted job (\d+)", result.stdout).group(1)
    run = tmp_path / "from-elsewhere"
    rendered = load_config(run / "config.toml")  # the job reads absolute paths, wherever it starts
    assert rendered.data.path == str(elsewhere / "data" / "reverse_train.jsonl")
    assert rendered.rollout.agent == str(elsewhere / "envs" / "reverse.py")
    assert slurm_cluster.wait_end(job, 90) == "COMPLETED"
    assert_each_step_once(run, 5)


def test_hand_submitted_script_runs_the_same_driver(slurm_cluster, tmp_path, tiny_model_dir) -> None:
    script = tmp_path / "job.sh"
    files = [f"data.path={ROOT / 'data' / 'reverse_train.jsonl'}", f"rollout.agent={ROOT / 'envs' / 'reverse.py'}"]
    args = sets(f"run.root={tmp_path}", "run.name=by-hand", f"model.path={tiny_model_dir}", "run.steps=10", *STANDINS,
                *files)  # fmt: skip
    assert molt("sbatch", *args, "-o", str(script), cwd=tmp_path).returncode == 0  # Slurm's log lands there
    run = tmp_path / "by-hand"
    assert not run.exists()  # rendering creates nothing; the driver writes the run directory
    job = slurm_cluster.slurm("sbatch", "--parsable", str(script)).strip().split("+")[0]
    assert slurm_cluster.wait_end(job, 90) == "COMPLETED"
    assert (run / "slurm_job_id").read_text().strip() == job
    assert (run / "config.toml").exists() and (run / "control" / "done").exists()
    assert "job ended: {'status': 'done'" in (tmp_path / f"slurm-{job}.out").read_text()
    assert_each_step_once(run, 10)


def test_time_limit_warning_checkpoints_requeues_and_resumes(slurm_cluster, background_jobs) -> None:
    job, run = background_jobs["time-limit"]

    def resumed_and_trained() -> bool:
        later = [e for e in events(run, "actor", "step") if e["restart"] >= 1]
        return len(later) >= 2

    slurm_cluster.wait_for(resumed_and_trained, 150, "the requeued job to resume and train")
    assert "SIGUSR1: the actor pool checkpoints" in (run / "logs" / "driver.log").read_text()
    first_stop = events(run, "actor", "stopped")[0]
    assert (first_stop["restart"], first_stop["why"]) == (0, "control/stop")

    # It keeps being warned and requeued (each start gets the warning); a cancel ends it in any phase.
    cancelled = molt("cancel", str(run))
    assert cancelled.returncode == 0 and f"job {job}" in cancelled.stdout, cancelled.stderr
    assert slurm_cluster.wait_end(job, 60) == "CANCELLED"
    last = trained_steps(run)[-1]
    assert events(run, "actor", "checkpoint")[-1]["step"] == last
    assert_each_step_once(run, last)

    more = last + 5  # `submit --resume`: a new job continues the run from its checkpoint to the new end
    result = molt("submit", "--resume", str(run), *sets(f"run.steps={more}", "slurm.time=00:10:00"))
    assert result.returncode == 0, result.stderr
    new_job = re.search(r"submitted job (\d+)", result.stdout).group(1)
    assert slurm_job_state(run).startswith(f"job {new_job} ")
    assert slurm_cluster.wait_end(new_job, 90) == "COMPLETED"
    assert_each_step_once(run, more)


# -- the real entry points ------------------------------------------------------------------


def missing_entry_points() -> str | None:
    """Why the real pools cannot run as job steps yet, or None."""
    usage = subprocess.run([sys.executable, "jobs/engine.py", "--help"], cwd=ROOT, capture_output=True, text=True)
    if not (ROOT / "jobs" / "actor.py").exists() or "pool" not in usage.stdout:
        return "jobs/actor.py or `jobs/engine.py --role pool` does not exist yet"
    return None


def submit_real(root: Path) -> tuple[str, Path]:
    overrides = [f"run.root={root}", "run.name=real", f"run.steps={REAL_STEPS}"]
    overrides += ["slurm.actor.partition=train", "slurm.engines.partition=train"]
    result = molt("submit", "configs/tiny_cpu.toml", *sets(*overrides))
    assert result.returncode == 0, result.stderr
    return re.search(r"submitted job (\d+)", result.stdout).group(1), root / "real"


def actor_metrics(run: Path) -> list[dict]:
    return [r for r in read_metrics(run / "metrics.jsonl", source="actor") if "step" in r]


def preempt_real_run(cluster, job: str, run: Path) -> None:
    """A third of the way in, a job of partition `urgent` takes the run's engine node."""
    cluster.wait_for(lambda: len(actor_metrics(run)) >= REAL_STEPS // 3, 400, "a third of the real run", interval=1)
    _, engine_node = cluster.component_nodes(job)
    cluster.slurm("sbatch", "-p", "urgent", "-w", engine_node, "-c", "4", "-o", "/dev/null", "--wrap", "sleep 5")


@pytest.fixture(scope="module")
def real_run(slurm_cluster, background_jobs) -> tuple[str, Path]:
    if "real" not in background_jobs:
        pytest.skip(missing_entry_points() or "the real run was not submitted")
    job, run = background_jobs["real"]
    assert slurm_cluster.wait_end(job, 500) == "COMPLETED"
    return job, run


@pytest.mark.slow
def test_real_pools_run_the_tiny_config_to_completion_and_learn(real_run) -> None:
    _, run = real_run
    # Quiet, truthful logs: the requeue's stop is a clean stop of every process, not a crash.
    actor_log, pool_log = ((run / "logs" / f"{n}.log").read_text() for n in ("actor", "pool"))
    assert "SignalException" not in actor_log and "Traceback" not in actor_log
    assert "died (exit 0)" not in pool_log and "restarting" not in pool_log and "CANCELLED" not in pool_log
    records = actor_metrics(run)
    assert [r["step"] for r in records] == list(range(1, REAL_STEPS + 1))  # each step once, across the requeue
    rewards = [r["reward"] for r in records]
    quarter = len(rewards) // 4
    first, last = sum(rewards[:quarter]) / quarter, sum(rewards[-quarter:]) / quarter
    assert last > first, f"no learning: mean reward {first:.4f} in the first quarter, {last:.4f} in the last"


@pytest.mark.slow
def test_real_pools_preempted_train_the_groups_of_an_uninterrupted_run(slurm_cluster, real_run) -> None:
    job, run = real_run
    assert slurm_cluster.job_field(job, "Restarts") == "1"
    assert "SIGUSR1: the actor pool checkpoints" in (run / "logs" / "driver.log").read_text()
    trained = acked_ids(find_spool(run))
    assert len(trained) == len(set(trained)), "a group was trained twice"
    per_step = load_config(ROOT / "configs" / "tiny_cpu.toml").actor.groups_per_step
    assert len(trained) == REAL_STEPS * per_step, "groups were lost or added"
