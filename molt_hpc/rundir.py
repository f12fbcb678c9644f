"""The run directory: its layout, its secret token, and atomic file publication.

    runs/<name>/
      config.toml      the resolved config that ran
      rendezvous/      addresses (refit store, engines, router) and the run's secret token
      buffer/          the replay buffer spool
      checkpoints/     step_N/ directories and the `latest` pointer
      logs/            one log per process
      metrics.jsonl    one JSON line per training step (and rollout/engine records)

The directory is private to the user (0700): it holds the token that HTTP endpoints require.
"""

import os
import secrets
from dataclasses import dataclass
from pathlib import Path

TOKEN_HEADER = "Authorization"


def atomic_write(path: str | Path, data: bytes | str, mode: int = 0o600, durable: bool = True) -> None:
    """Write `path` so readers see the old file or the whole new one: temp name, fsync, rename.
    `durable=False` skips the two fsyncs, for what need not outlive the machine (a live process's
    registration), where they would cost milliseconds on every write."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    payload = data.encode() if isinstance(data, str) else data
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.write(fd, payload)
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    if durable:
        fsync_dir(path.parent)


def fsync_dir(path: str | Path) -> None:
    """Make a rename in `path` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def private_files() -> None:
    """Make everything this process creates from now on private to the user: directories 0700,
    files 0600. Every process of a run calls it first thing. A process-wide umask rather than explicit
    modes: much of what a run writes is created by other libraries (torch.save, safetensors,
    save_pretrained, tokenizers, logging handlers, vLLM), which take no mode, so only the umask reaches
    them all, and a directory created anywhere (control/, models/, a checkpoint's policy/) is covered
    without each call site remembering. A checkpoint a user exports is theirs to open up."""
    os.umask(0o077)


@dataclass(frozen=True)
class RunDir:
    """Paths inside one run directory."""

    path: Path

    @property
    def config(self) -> Path:
        return self.path / "config.toml"

    @property
    def rendezvous(self) -> Path:
        return self.path / "rendezvous"

    @property
    def buffer(self) -> Path:
        return self.path / "buffer"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def logs(self) -> Path:
        return self.path / "logs"

    @property
    def metrics(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def models(self) -> Path:
        """Where builtin models are built for this run."""
        return self.path / "models"

    @property
    def token_file(self) -> Path:
        return self.rendezvous / "token"

    def token(self) -> str:
        """The run's secret; HTTP endpoints refuse requests that do not carry it."""
        return self.token_file.read_text().strip()

    def auth_headers(self) -> dict[str, str]:
        return {TOKEN_HEADER: f"Bearer {self.token()}"}


def create_run_dir(root: str | Path, name: str, config_toml: str) -> RunDir:
    """Make (or reopen) a private run directory, write its config and make its token once."""
    run = RunDir(Path(root).absolute() / name)
    old_umask = os.umask(0o077)
    try:
        for sub in (run.path, run.rendezvous, run.buffer, run.checkpoints, run.logs):
            sub.mkdir(parents=True, exist_ok=True)
        os.chmod(run.path, 0o700)
        if not run.token_file.exists():
            atomic_write(run.token_file, secrets.token_urlsafe(32))
        atomic_write(run.config, config_toml)
    finally:
        os.umask(old_umask)
    return run
