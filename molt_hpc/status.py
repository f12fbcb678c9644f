"""`molt-hpc status RUN_DIR`: where a run is — step, reward trend, throughput, buffer, checkpoint,
processes, and the Slurm job state when it runs on Slurm. Reads only files of the run directory.
"""

import json
import time
from pathlib import Path

from molt_hpc import records
from molt_hpc.buffer.cleanup import pid_alive
from molt_hpc.log import read_metrics, training_steps
from molt_hpc.plot import reward_summary


def _ago(t: float) -> str:
    s = max(0.0, time.time() - t)
    return f"{s:.0f} s ago" if s < 120 else f"{s / 60:.0f} min ago"


def status_lines(run_dir: str | Path) -> list[str]:
    run_dir = Path(run_dir)
    if not (run_dir / "config.toml").is_file():
        raise ValueError(f"{run_dir} is not a run directory (no config.toml)")
    from molt_hpc.config import load_config

    cfg = load_config(run_dir / "config.toml")
    lines = [f"run: {run_dir}"]
    actor = training_steps(read_metrics(run_dir / "metrics.jsonl", source="actor"))
    if actor:
        last = actor[-1]
        lines.append(
            f"step: {last['step']}/{cfg.run.steps} (policy version {last.get('version', '?')}), "
            f"last step {_ago(last['time'])}"
        )
        if cfg.run.stage == "rl":
            lines.append(reward_summary(actor))
        else:  # SFT or a reward model: its held-out number instead of a reward
            from molt_hpc.records import stage_summary

            lines.append(stage_summary(Path(run_dir), cfg.run.stage)[0])
        if last.get("tokens_per_s") is not None:
            lines.append(f"trainer: {last['tokens_per_s']:.0f} tokens/s")
    else:
        lines.append(f"step: 0/{cfg.run.steps} (no training step recorded yet)")
    rollout = read_metrics(run_dir / "metrics.jsonl", source="rollout")
    rate = records.rollout_rate(rollout, until=actor[-1]["time"] if actor else None)
    if rate is not None:
        lines.append(f"rollout: {rate[0]:.2f} groups/s, {rate[1]:.0f} tokens/s (the last {rate[2]} windows)")
    if (line := records.eval_summary(run_dir)) is not None:
        lines.append(line)
    if cfg.run.stage == "rl" and actor:  # the plan's speed prediction beside what the run measured
        from molt_hpc.plan.speed_text import run_speed_lines

        lines.extend(run_speed_lines(cfg, actor, rollout, Path(run_dir)))
    if cfg.run.stage == "rl":
        lines.append(_buffer_line(run_dir))
    lines.append(_checkpoint_line(run_dir))
    lines.extend(_pool_lines(run_dir, rollout))
    slurm = _slurm_lines(run_dir)
    lines.extend(slurm or _process_lines(run_dir))  # a Slurm run's processes are its job steps
    failure = _failure_line(run_dir)
    if failure:
        lines.append(failure)
    return lines


def _pool_lines(run_dir: Path, rollout: list[dict]) -> list[str]:
    """One line per extra engine pool (`molt-hpc engines add`), and the tokens requests carried across engines."""
    from molt_hpc.launch.elastic import pool_rows
    from molt_hpc.launch.slurm.extra import slurm_state
    from molt_hpc.rundir import RunDir

    lines = []
    for r in pool_rows(RunDir(run_dir.absolute()), slurm_state):
        versions = ",".join(map(str, r["versions"])) or "-"
        lines.append(f"pool {r['pool']} ({r['mode']}, {r['job']}): {r['engines']} engine(s), {r['in_ring']} in the "
                     f"ring, version {versions}, {r['requests']} requests, {r['state']}")  # fmt: skip
    moved = sum(int(x.get("tokens_migrated", 0)) for x in rollout)
    lost = sum(int(x.get("tokens_discarded", 0)) for x in rollout)
    if moved or lost:
        lines.append(f"migration: {moved} tokens continued on another engine, {lost} discarded")
    return lines


def _buffer_line(run_dir: Path) -> str:
    from molt_hpc.buffer import find_spool, spool_counts

    try:
        root = find_spool(run_dir)
    except ValueError as err:  # removed after the run finished, or never created
        return f"buffer: {err}"
    if not root.is_dir():
        return f"buffer: {root} is gone (a /dev/shm spool does not survive a reboot)"
    counts = spool_counts(root)
    states = ("pending", "claimed", "acked", "stale", "quarantined")
    return "buffer: " + ", ".join(f"{k} {counts[k]}" for k in states)


def _checkpoint_line(run_dir: Path) -> str:
    from molt_hpc.checkpoint import latest_checkpoint

    latest = latest_checkpoint(run_dir / "checkpoints")
    if latest is None:
        return "last checkpoint: none yet"
    return f"last checkpoint: {latest.name} ({_ago(latest.stat().st_mtime)})"


def _process_lines(run_dir: Path) -> list[str]:
    path = run_dir / "processes.json"
    if not path.exists():
        return ["processes: none recorded"]
    procs = json.loads(path.read_text())
    done = (run_dir / "control" / "done").exists()
    parts = [f"{name} (pid {pid}) {'alive' if pid_alive(pid) else 'exited'}" for name, pid in procs.items()]
    return [("processes: " if not done else "finished; processes: ") + ", ".join(parts)]


def _slurm_lines(run_dir: Path) -> list[str]:
    """The run's Slurm job (state, restarts, nodes) and its running steps; [] for a local run."""
    from molt_hpc.launch.slurm.state import (
        job_components,
        job_step_lines,
        queue_detail,
        read_job_id,
        slurm_job_state,
    )

    state = slurm_job_state(run_dir)
    if state is None:
        return []
    detail = queue_detail(run_dir) if state.endswith(" PENDING") else None
    lines = [f"slurm: {state}" + (f" ({detail})" if detail else "")]
    job_id = read_job_id(run_dir)
    comps = job_components(job_id)
    if comps:
        nodes = " + ".join(c.get("NodeList") or "(none yet)" for c in comps)
        groups = " + ".join(str(i) for i in range(len(comps)))
        lines.append(f"job: restarts {comps[0].get('Restarts', '0')}, nodes {nodes} (het groups {groups})")
    steps = job_step_lines(job_id)
    return [*lines, "job steps: " + ("; ".join(steps) if steps else "none running")]


def _failure_line(run_dir: Path) -> str | None:
    """Why the run stopped on its own (a breaker, a failed job), as recorded in control/failed."""
    from molt_hpc.fault import read_failure

    failure = read_failure(run_dir)
    if failure is None:
        return None
    return f"failed ({failure.get('source', '?')}, {_ago(failure['time'])}): {failure['reason']}"
