"""How one execution is confined: the bubblewrap command line, the rlimits, the user it runs as.

`bwrap` (the distribution's bubblewrap: unprivileged user namespaces, no daemon, no Docker) gives the
code new user, PID, network, IPC, UTS and cgroup namespaces: no network but a loopback that is down,
its own PID space (it cannot see or signal the server, and killing bwrap ends every process inside), a
root that holds only the read-only system binds, `/proc`, a minimal `/dev`, a size-capped tmpfs at
`/work` (its working directory, with the request's files) and at `/tmp`, and the code itself read-only
at `/sandbox/main.py`. Nothing of the run directory (token, buffer, checkpoints) is mounted.

`rlimit` is the explicit fallback: the same rlimits and a private temporary working directory, nothing
else (the code sees what the server's user sees). `auto` probes bwrap once and falls back loudly.

The rlimits (CPU seconds, address space, file size, processes) are set in the child before it runs
bwrap, so they bind everything inside. RLIMIT_NPROC counts every process of the real user id, so a
server running as root gives each worker slot its own unprivileged user id (claimed from `UID_BASE` up
with a lock held for the server's life, so two servers on one machine never share one): the limit is
then exactly the execution's own, and the code owns none of the host's files. Any other user gets the
limit on top of the processes it already runs.
"""

import fcntl
import os
import resource
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from molt_hpc.config.sandbox import SandboxConfig
from molt_hpc.log import get_logger

UID_BASE = 61000
"""First user id of the worker slots when the server runs as root (one id per slot, none owns a file)."""
UID_RANGE = 4096
"""User ids tried from `UID_BASE` for slots."""
UID_LOCKS = Path(tempfile.gettempdir()) / "molt-sandbox-uids"
"""Where a root server holds one lock per user id it runs executions as."""
PROBE_USER = 65534
"""`nobody`: the user a root server probes bwrap as (the slots' users are unprivileged like it)."""
WORK = "/work"
CODE = "/sandbox/main.py"
PATH_ENV = "/usr/local/bin:/usr/bin:/bin"


@dataclass(frozen=True)
class Limits:
    """The limits of one execution."""

    wall_s: float
    memory_bytes: int
    max_procs: int
    file_bytes: int
    output_bytes: int

    @property
    def cpu_s(self) -> int:
        return max(1, int(-(-self.wall_s // 1)))  # the wall limit rounded up


def claim_users(count: int) -> list[int | None]:
    """The user id each of `count` slots runs as: when this process is root, `count` ids no other server
    holds (locks kept open for this process's life; the kernel drops them when it dies); else None each
    (the server's own id)."""
    if os.geteuid() != 0:
        return [None] * count
    UID_LOCKS.mkdir(mode=0o700, exist_ok=True)
    if UID_LOCKS.stat().st_uid != 0 or UID_LOCKS.is_symlink():
        raise RuntimeError(f"{UID_LOCKS} is not root's own directory; remove it")
    users: list[int | None] = []
    for uid in range(UID_BASE, UID_BASE + UID_RANGE):
        fd = os.open(UID_LOCKS / str(uid), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # another server's
            os.close(fd)
            continue
        _held.append(fd)
        users.append(uid)
        if len(users) == count:
            return users
    raise RuntimeError(f"no free sandbox user id in {UID_BASE}..{UID_BASE + UID_RANGE - 1}")


_held: list[int] = []
"""Lock files of the claimed user ids, open until the process exits."""


def pids_of(uid: int) -> list[int]:
    """Processes of user `uid` now."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid:
                    found.append(int(entry.name))
            except OSError:  # it exited while we looked
                continue
    return found


def become_subreaper() -> None:
    """Have this process inherit its descendants' orphans (bwrap's PID-namespace init once bwrap is killed),
    so it reaps them at once instead of leaving them to the machine's init, whenever that gets to it."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_child_subreaper = 36
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_child_subreaper, 1)


def own_tasks(uid: int) -> int:
    """Tasks (processes and threads) user `uid` runs now: what RLIMIT_NPROC counts against."""
    total = 0
    for pid in pids_of(uid):
        try:
            with open(f"/proc/{pid}/status", "rb") as f:
                threads = next((ln for ln in f if ln.startswith(b"Threads:")), b"Threads: 1")
            total += int(threads.split()[1])
        except (OSError, ValueError):
            continue
    return total


def preexec(limits: Limits, nproc: int):
    """The function the child runs before exec: its rlimits (a fresh session is `start_new_session`)."""

    def apply() -> None:
        cpu = limits.cpu_s
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU at cpu, SIGKILL a second later
        resource.setrlimit(resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes))
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_bytes, limits.file_bytes))
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    return apply


def bwrap_argv(cfg: SandboxConfig, limits: Limits, code_fd: int, files: dict[str, int]) -> list[str]:
    """The bwrap command that runs the code read from `code_fd` with `files` (name -> fd) in `/work`."""
    argv = ["bwrap", "--unshare-all", "--die-with-parent", "--new-session", "--clearenv"]
    for path in cfg.binds:
        argv += ["--ro-bind-try", path, path]
    argv += ["--proc", "/proc", "--dev", "/dev"]
    argv += ["--size", str(limits.file_bytes), "--tmpfs", "/tmp"]
    argv += ["--size", str(limits.file_bytes), "--tmpfs", WORK]
    for name in sorted(files):
        for parent in reversed(Path(name).parents[:-1]):
            argv += ["--dir", f"{WORK}/{parent}"]
        argv += ["--file", str(files[name]), f"{WORK}/{name}"]
    argv += ["--ro-bind-data", str(code_fd), CODE, "--remount-ro", "/", "--chdir", WORK]
    argv += ["--setenv", "PATH", PATH_ENV, "--setenv", "HOME", WORK, "--setenv", "PYTHONDONTWRITEBYTECODE", "1"]
    return [*argv, cfg.python, "-I", CODE]


def rlimit_env(work: str) -> dict[str, str]:
    """The whole environment of an rlimit-mode child: nothing of the server's (its token paths, its keys)."""
    return {"PATH": PATH_ENV, "HOME": work, "PYTHONDONTWRITEBYTECODE": "1", "TMPDIR": work}


def check_python(cfg: SandboxConfig) -> None:
    if not os.access(cfg.python, os.X_OK):
        raise ValueError(
            f"sandbox.python = {cfg.python!r} is not an executable file here: point it at a system python3"
        )
    resolved = Path(cfg.python).resolve()
    if not any(resolved.is_relative_to(Path(b).resolve()) for b in cfg.binds if Path(b).exists()):
        raise ValueError(
            f"sandbox.python = {cfg.python!r} ({resolved}) lies under none of sandbox.binds {cfg.binds}: the "
            "sandbox could not run it; use a system python3 or add its (read-only, run-free) directory to binds"
        )


def bwrap_works(cfg: SandboxConfig, user: int | None) -> str | None:
    """None when bwrap can run `sandbox.python` here (as `user`), else why not."""
    if shutil.which("bwrap") is None:
        return "bwrap is not installed (apt-get install bubblewrap / dnf install bubblewrap)"
    argv = ["bwrap", "--unshare-all", "--die-with-parent", "--clearenv"]
    for path in cfg.binds:
        argv += ["--ro-bind-try", path, path]
    argv += ["--proc", "/proc", "--dev", "/dev", cfg.python, "-I", "-c", "print(6 * 7)"]
    ids = {} if user is None else {"user": user, "group": user, "extra_groups": []}
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL, **ids)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"bwrap did not run: {err}"
    if done.returncode != 0 or done.stdout.strip() != "42":
        return f"bwrap exited {done.returncode}: {done.stderr.strip()[-300:]} (user namespaces disabled?)"
    return None


def _refusal(why: str) -> str:
    return (
        f"sandbox.isolation = 'bwrap' but {why}: install bubblewrap, enable unprivileged user namespaces, "
        "or set sandbox.isolation = 'auto' (falls back to rlimits)"
    )


def _fallback(why: str) -> str:
    return (
        f"SANDBOX FALLBACK: {why}; untrusted code now runs under rlimits only, with the host's files and network "
        "visible to it as they are to this user. Install bubblewrap for real isolation."
    )


def choose(cfg: SandboxConfig, warn=None) -> str:
    """The isolation this machine gives `cfg`: `bwrap` or `rlimit`; `ValueError` when `bwrap` is asked and
    fails, or `sandbox.python` cannot run. A fallback or rlimits by choice go to `warn` (default: the log)."""
    warn = warn or get_logger().warning
    check_python(cfg)
    if cfg.isolation == "rlimit":
        warn("sandbox.isolation = 'rlimit': executions are confined by rlimits only (weak)")
        return "rlimit"
    why = bwrap_works(cfg, PROBE_USER if os.geteuid() == 0 else None)
    if why is None:
        return "bwrap"
    if cfg.isolation == "bwrap":
        raise ValueError(_refusal(why))
    warn(_fallback(why))
    return "rlimit"
