"""A run directory's Slurm job: its id on file, its state as Slurm reports it, the control files.

The id is written at submission (and again by the driver at every start, for hand-submitted
scripts) to `RUN_DIR/slurm_job_id`. The state comes from `squeue`, then `scontrol` (finished jobs
stay there for MinJobAge), then `sacct` (clusters with accounting); None when Slurm is unreachable.
"""

import shutil
import subprocess
from pathlib import Path

from molt_hpc.rundir import atomic_write

JOB_ID_FILE = "slurm_job_id"
ACTIVE_STATES = frozenset(
    {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "REQUEUE_HOLD", "RESIZING",
     "SIGNALING", "STAGE_OUT", "STOPPED", "PREEMPTED", "REQUEUE_FED"}
)  # fmt: skip
"""States in which the job still holds (or waits for) an allocation."""


def control_file(run_dir: str | Path, name: str) -> Path:
    """`RUN_DIR/control/<name>`: `stop` and `checkpoint` (read by the actor pool), `done` (written by
    it when training is finished), `cancel` (read by the driver: end the job after a checkpoint)."""
    return Path(run_dir) / "control" / name


def touch_control(run_dir: str | Path, name: str) -> None:
    path = control_file(run_dir, name)
    path.parent.mkdir(mode=0o700, exist_ok=True)
    atomic_write(path, "")


def record_job_id(run_dir: str | Path, job_id: str) -> None:
    atomic_write(Path(run_dir) / JOB_ID_FILE, f"{job_id}\n")


def read_job_id(run_dir: str | Path) -> str | None:
    try:
        return (Path(run_dir) / JOB_ID_FILE).read_text().strip() or None
    except FileNotFoundError:
        return None


def _query(*cmd: str) -> str:
    if shutil.which(cmd[0]) is None:
        return ""
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:  # a slow controller: report the state as unknown, not crash status
        return ""
    return out.stdout if out.returncode == 0 else ""


def job_state(job_id: str) -> str | None:
    """The state of job `job_id` (its het leader's, for a het job), e.g. `RUNNING`; None if Slurm does not know it."""
    for line in _query("squeue", "-h", "-j", job_id, "-o", "%i %T").splitlines():
        jid, _, state = line.partition(" ")
        if jid in (job_id, f"{job_id}+0"):
            return state.strip()
    leader = next(iter(_query("scontrol", "-o", "show", "job", job_id).splitlines()), "")
    fields = dict(token.partition("=")[::2] for token in leader.split())
    if fields.get("JobState"):
        return fields["JobState"]
    for line in _query("sacct", "-n", "-X", "-P", "-j", job_id, "-o", "JobID,State").splitlines():
        jid, _, state = line.partition("|")
        if jid in (job_id, f"{job_id}+0"):
            return state.split()[0] if state else None
    return None


def job_components(job_id: str) -> list[dict[str, str]]:
    """`scontrol show job` of every component of job `job_id` (het offset order); [] when Slurm does not know it."""
    lines = _query("scontrol", "-o", "show", "job", job_id).splitlines()
    comps = [dict(token.partition("=")[::2] for token in line.split()) for line in lines if line.strip()]
    return sorted(comps, key=lambda f: int(f.get("HetJobOffset", 0) or 0))


STOP_CAUSES = ("requeued", "preempted", "time limit", "cancelled", "signal")


def stop_cause(job_id: str, restarts_seen: int) -> str:
    """Why the job's processes got SIGTERM, from the job's own record at that moment (measured on slurm 22.05):

    - `requeued`: Slurm is requeueing it (a preemption in REQUEUE mode, `scontrol requeue`): Restarts has
      already gone past this start's SLURM_RESTART_COUNT;
    - `preempted`: a preemption is under way (PreemptTime is set; the TERM comes after the GraceTime);
    - `time limit`: the time limit is reached (Reason=TimeLimit);
    - `cancelled`: `scancel` (the job is CANCELLED or COMPLETING, none of the above);
    - `signal`: the job still RUNNING, none of the above: a SIGTERM sent by hand (`scancel --signal`, kill).
    """
    comps = job_components(job_id)
    if not comps:
        return "signal"
    if max(int(c.get("Restarts", 0) or 0) for c in comps) > restarts_seen:
        return "requeued"
    if any(c.get("PreemptTime") not in (None, "", "None") for c in comps):
        return "preempted"
    if any(c.get("Reason") == "TimeLimit" or c.get("JobState") == "TIMEOUT" for c in comps):
        return "time limit"
    if comps[0].get("JobState") in ("CANCELLED", "COMPLETING"):
        return "cancelled"
    return "signal"


def job_step_lines(job_id: str) -> list[str]:
    """`<step id> <name> on <nodes>, <time>` for each running step of the job (every het component)."""
    ids = ",".join(c["JobId"] for c in job_components(job_id) if c.get("JobId")) or job_id
    out = _query("squeue", "-h", "-s", "-j", ids, "-o", "%i|%j|%N|%M")
    steps = [line.split("|") for line in out.splitlines() if line.count("|") == 3]
    return [f"{sid} {name} on {nodes}, {used}" for sid, name, nodes, used in steps if not sid.endswith(".batch")]


def slurm_job_state(run_dir: str | Path) -> str | None:
    """`job <id> <STATE>` for the run's latest Slurm job; None when the run never went to Slurm."""
    job_id = read_job_id(run_dir)
    if job_id is None:
        return None
    return f"job {job_id} {job_state(job_id) or 'UNKNOWN (Slurm does not know it any more)'}"


def queue_detail(run_dir: str | Path) -> str | None:
    """For a pending job: why it waits and when Slurm expects it to start (`squeue`'s %r and %S)."""
    job_id = read_job_id(run_dir)
    if job_id is None:
        return None
    for line in _query("squeue", "-h", "-j", job_id, "-o", "%i|%T|%r|%S").splitlines():
        jid, state, reason, start = [*line.split("|"), "", "", ""][:4]
        if jid not in (job_id, f"{job_id}+0") or state != "PENDING":
            continue
        when = "Slurm gives no estimate yet" if start in ("", "N/A") else f"Slurm expects it to start at {start}"
        return f"waiting in the queue: reason {reason or 'none given'}; {when}"
    return None
