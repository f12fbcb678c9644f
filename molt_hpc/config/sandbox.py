"""`[sandbox]`: the service that runs untrusted code (model-written Python) for envs (`ctx.sandbox`).

Optional: without the section no sandbox process starts and `state.sandbox` says how to add one.
Each execution is a fresh `python3` with no network, a read-only view of the system directories only
(never the run directory), a private size-capped tmpfs as its working directory, and CPU, wall, memory,
process and output limits. See docs/sandbox.md.
"""

from typing import Literal

from pydantic import Field, PositiveFloat, PositiveInt

from molt_hpc.config.base import Section

DEFAULT_BINDS = ["/usr", "/bin", "/lib", "/lib64", "/sbin"]


class SandboxConfig(Section):
    """The sandbox server (a local process of the engine pool's first node) and its limits per execution."""

    isolation: Literal["auto", "bwrap", "rlimit"] = "auto"
    """`bwrap`: bubblewrap namespaces (no network, no view of the host's files, own PID space) plus the
    rlimits; the server refuses to start when bwrap does not work here. `rlimit`: the rlimits alone in a
    plain subprocess (weak: the code sees the host's files and network as the server's user does; only for
    machines without bwrap). `auto`: bwrap when it works, else rlimit with a warning in the log."""
    workers: PositiveInt = 2
    """Executions that run at once (one CPU core each is the right size)."""
    max_queue: PositiveInt = 64
    """Executions waiting for a worker; a request past that is answered 429 and the client retries it."""
    timeout_s: PositiveFloat = 5.0
    """Wall-clock limit of one execution (a call may ask for less, never more); its CPU-time limit is the
    same number of seconds, rounded up. Past it the execution's whole process tree is killed."""
    memory_mb: PositiveInt = 512
    """Address-space limit (RLIMIT_AS) of the executed program, in MiB."""
    max_procs: PositiveInt = 16
    """Processes and threads the executed program may have at once (a fork bomb stops here)."""
    max_output_bytes: PositiveInt = 1 << 20
    """Bytes of stdout and of stderr kept; a program that writes more is killed (`killed_reason = "output"`)."""
    max_file_mb: PositiveInt = 16
    """Largest file the program may write (RLIMIT_FSIZE), and the size of its private working directory."""
    python: str = "/usr/bin/python3"
    """Interpreter that runs the code: a system Python under one of `binds` (not the run's virtualenv,
    which may live next to the run directory)."""
    binds: list[str] = Field(default_factory=lambda: list(DEFAULT_BINDS))
    """Host directories the code sees, read-only (bwrap; those missing here are skipped). Keep out any
    directory that holds run directories, tokens or home directories."""
