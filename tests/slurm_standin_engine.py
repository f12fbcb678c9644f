"""Stand-in for `jobs/engine.py --role pool` in the Slurm driver tests: the pool's contract, no engines.

Run as `SCRIPT RUN_DIR --role pool` on every node of het group 1; it records where it runs
(`RUN_DIR/standin/engine.jsonl`) and idles until SIGTERM or SIGINT, then exits 0, like the real pool.
Fault injection: MOLT_STANDIN_ENGINE_FAIL_AFTER=S exits with code 3 after S seconds (every launch);
MOLT_STANDIN_ENGINE_CONFIG_ERROR=TEXT records TEXT as the run's failure, a config error, the way the real
orchestrator records one it finds at run time (`molt_hpc.fault`), and exits with code 2.
Its start event also records the children the real pool would start on this node (`pool_children` of
the run's config at `SLURM_NODEID`, without the sandbox under `--no-sandbox`): each engine process's
`--index ...` arguments and the services. As `SCRIPT RUN_DIR --role sandboxes` (het group 2 of a run with
`[sandbox]`) it records where it runs and becomes the real `jobs/engine.py --role sandboxes`: the sandbox
server, really serving.
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

RUN = Path(sys.argv[1])
FAIL_AFTER = float(os.environ.get("MOLT_STANDIN_ENGINE_FAIL_AFTER", "0"))
CONFIG_ERROR = os.environ.get("MOLT_STANDIN_ENGINE_CONFIG_ERROR")
stopping = []
signal.signal(signal.SIGTERM, lambda s, f: stopping.append(s))
signal.signal(signal.SIGINT, lambda s, f: stopping.append(s))  # the driver stops the pool step with INT


def record(event: str, **fields) -> None:
    (RUN / "standin").mkdir(exist_ok=True)
    line = {
        "event": event,
        "pid": os.getpid(),
        "time": time.time(),
        "node": os.environ.get("SLURMD_NODENAME"),
        "procid": os.environ.get("SLURM_PROCID"),
        "step_id": os.environ.get("SLURM_STEP_ID"),
        "restart": int(os.environ.get("SLURM_RESTART_COUNT", "0")),
        **fields,
    }
    with open(RUN / "standin" / "engine.jsonl", "a") as f:
        f.write(json.dumps(line) + "\n")


def children(with_sandbox: bool) -> dict:
    """What the real pool runs on this node: engine processes (their arguments from `--index`), services."""
    from molt_hpc.config import load_config
    from molt_hpc.launch.pool import pool_children
    from molt_hpc.rundir import RunDir

    run = RunDir(RUN)
    node = int(os.environ.get("SLURM_NODEID", "0"))
    engines, services = pool_children(load_config(run.config), run, node, with_sandbox=with_sandbox)
    return {
        "engines": [c.cmd[c.cmd.index("--index") :] if "--index" in c.cmd else c.name for c in engines],
        "services": [c.name for c in services],
    }


def main() -> int:
    if sys.argv[2:] == ["--role", "sandboxes"]:
        record("sandboxes")
        engine = Path(__file__).resolve().parents[1] / "jobs" / "engine.py"
        os.execv(sys.executable, [sys.executable, "-u", str(engine), *sys.argv[1:]])
    assert sys.argv[2:4] == ["--role", "pool"] and sys.argv[4:] in ([], ["--no-sandbox"]), sys.argv
    record("start", no_sandbox=sys.argv[4:] == ["--no-sandbox"], **children(sys.argv[4:] == []))
    if CONFIG_ERROR:
        from molt_hpc.fault import fail

        time.sleep(1.0)  # the actor pool is up and training when the error is found
        fail(RUN, CONFIG_ERROR, "rollout", config_error=True)
        record("config error")
        return 2
    started = time.monotonic()
    while not stopping:
        time.sleep(0.1)
        if FAIL_AFTER and time.monotonic() - started > FAIL_AFTER:
            record("fail")
            return 3
    record("stop")
    return 0


if __name__ == "__main__":
    sys.exit(main())
