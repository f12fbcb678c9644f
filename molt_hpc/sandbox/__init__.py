"""Sandboxed code execution for envs (`[sandbox]`): untrusted code runs with no network, no view of the run.

isolation.py  bubblewrap's command line, the rlimits, the user an execution runs as; `auto` picks
protocol.py   the typed bodies of `POST /run`
execute.py    one execution: spawn, feed stdin, capped output, wall clock, kill the tree
server.py     the server process (`jobs/engine.py RUN_DIR --role sandbox`): bounded pool and queue
client.py     `SandboxClient`, what envs call as `state.sandbox` (`await state.sandbox.run(code)`)

The server registers `RUN_DIR/rendezvous/sandbox.json` (`url`, `pid`, `isolation`) once it listens and
removes it on a clean stop; the engine pool restarts it when it dies. See docs/sandbox.md.
"""

from pathlib import Path

from molt_hpc.rundir import RunDir


def sandbox_file(run: RunDir) -> Path:
    return run.rendezvous / "sandbox.json"
