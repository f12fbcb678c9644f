"""Stand-in for `jobs/actor.py` in the Slurm driver tests: the actor pool's contract, no training.

Run by torchrun as `SCRIPT RUN_DIR` on every node of het group 0. Like the real trainer it resumes
from `RUN_DIR/checkpoints/latest`, trains up to `run.steps` steps (one "step" = one group id, every
MOLT_STANDIN_STEP_S seconds), checkpoints at the next step boundary and exits on `control/stop` or
SIGUSR1/SIGTERM, and writes `control/done` when finished. Rank 0 does the work; every rank records
its torchrun environment. Events go to `RUN_DIR/standin/actor.jsonl`.
Fault injection: MOLT_STANDIN_ACTOR_FAIL_AT=N exits with code 3 after step N.
Pacing: MOLT_STANDIN_HOLD="R:N,..." makes start R (SLURM_RESTART_COUNT) stop stepping after its N-th
step until a stop comes, so a test that preempts or requeues the job at that point cannot be outrun by
a run that finishes first (the scheduler's preemption may take many seconds on a loaded machine).
"""

import json
import os
import signal
import sys
import time
import tomllib
from pathlib import Path

RUN = Path(sys.argv[1])
RANK = int(os.environ["RANK"])
RESTART = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
STEP_S = float(os.environ.get("MOLT_STANDIN_STEP_S", "0.2"))
FAIL_AT = int(os.environ.get("MOLT_STANDIN_ACTOR_FAIL_AT", "0"))
HOLD = dict(tuple(map(int, h.split(":"))) for h in os.environ.get("MOLT_STANDIN_HOLD", "").split(",") if h)
signalled = []
signal.signal(signal.SIGUSR1, lambda s, f: signalled.append(signal.Signals(s).name))
signal.signal(signal.SIGTERM, lambda s, f: signalled.append(signal.Signals(s).name))


def record(event: str, **fields) -> None:
    (RUN / "standin").mkdir(exist_ok=True)
    line = {"event": event, "rank": RANK, "restart": RESTART, "pid": os.getpid(), "time": time.time(), **fields}
    with open(RUN / "standin" / "actor.jsonl", "a") as f:
        f.write(json.dumps(line) + "\n")


def latest_step() -> int:
    latest = RUN / "checkpoints" / "latest"
    return json.loads((latest / "state.json").read_text())["step"] if latest.exists() else 0


def save(step: int) -> None:
    """Publish checkpoint `step` atomically: write the directory, then swap the `latest` link."""
    ckpt = RUN / "checkpoints" / f"step_{step}"
    ckpt.mkdir(parents=True, exist_ok=True)
    (ckpt / "state.json").write_text(json.dumps({"step": step}))
    tmp = RUN / "checkpoints" / f".latest.{os.getpid()}"
    tmp.symlink_to(ckpt.name)
    os.replace(tmp, RUN / "checkpoints" / "latest")
    record("checkpoint", step=step)


def stop_requested() -> bool:
    return bool(signalled) or (RUN / "control" / "stop").exists()


def main() -> int:
    steps = tomllib.loads((RUN / "config.toml").read_text())["run"]["steps"]
    env = {k: os.environ.get(k) for k in ("WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURMD_NODENAME")}
    step = latest_step()
    record("start", resume_step=step, env=env)
    exit_flag = RUN / "standin" / f"actor-exit-{RESTART}"
    if RANK != 0:  # other ranks follow rank 0 (the real trainer's ranks stop together)
        while not exit_flag.exists():
            time.sleep(0.1)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        return 0
    try:
        held = 0
        while step < steps:
            time.sleep(STEP_S)
            if RESTART in HOLD and held >= HOLD[RESTART] and not stop_requested():
                continue  # holding: no step until the stop this start waits for
            step += 1
            held += 1
            record("step", step=step)
            if FAIL_AT and step == FAIL_AT:
                record("fail", step=step)
                return 3
            if stop_requested():
                save(step)
                record("stopped", step=step, why=signalled[0] if signalled else "control/stop")
                return 0
        save(step)
        (RUN / "control").mkdir(exist_ok=True)
        (RUN / "control" / "done").touch()
        record("done", step=step)
        return 0
    finally:
        exit_flag.touch()
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # as jobs/actor.py: a late copy of the stop is no death


if __name__ == "__main__":
    sys.exit(main())
