"""The spool on disk: its directories, its file names, the moves between states, and its counts.

    <root>/
      pending/NAME              published, unclaimed groups (what `capacity` counts)
      claimed/<consumer>/NAME   groups a consumer holds until it acks them
      acked/NAME                acked groups, truncated to 0 bytes: the ledger of what was consumed
      stale/NAME                groups older than `max_staleness`, kept for inspection
      quarantine/NAME           corrupt or foreign files; `quarantine/.reasons/NAME.txt` says why
      leases/<consumer>         a consumer's lease, rewritten on every renewal
      producers/<producer>/ID   one empty marker per group id a producer has put
      tmp/<producer>/NAME       a group being written (consumers never look here)

NAME is `<time_ns>+<producer>+<seq>+v<min_version>+<group_id>.safetensors`: sorting names sorts
by put time (FIFO), and the oldest policy version in the name lets staleness be judged without
reading the file. Every state change is one rename — the one operation a shared filesystem
(Lustre, GPFS, NFS) makes atomic — and a file keeps its name in every state. Names starting
with a dot are never touched (temporary files, NFS's `.nfsXXXX`).
"""

import hashlib
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

from molt_hpc.log import get_logger
from molt_hpc.rundir import atomic_write

ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
NAME_PATTERN = re.compile(r"^(\d{19})\+([A-Za-z0-9._-]+)\+(\d+)\+v(\d+)\+([A-Za-z0-9._-]+)\.safetensors$")
SHM_BASE = Path("/dev/shm")
LOCATION_FILE = "location"
"""In `RUN_DIR/buffer/`, the path of a spool that lives elsewhere (the `shm` backend)."""


def check_id(kind: str, value: str) -> str:
    if not isinstance(value, str) or not ID_PATTERN.match(value):
        raise ValueError(
            f"{kind} {value!r} cannot name a buffer file: use 1-64 characters from A-Z a-z 0-9 . _ - "
            "(starting with a letter or digit)"
        )
    return value


@dataclass(frozen=True)
class SpoolName:
    """The parts of a group file's name."""

    time_ns: int
    producer: str
    seq: int
    min_version: int
    group_id: str

    def __str__(self) -> str:
        return f"{self.time_ns:019d}+{self.producer}+{self.seq:06d}+v{self.min_version}+{self.group_id}.safetensors"

    @classmethod
    def parse(cls, name: str) -> "SpoolName | None":
        m = NAME_PATTERN.match(name)
        if m is None:
            return None
        return cls(int(m[1]), m[2], int(m[3]), int(m[4]), m[5])


@dataclass(frozen=True)
class Spool:
    """The paths of one spool."""

    root: Path

    pending = property(lambda self: self.root / "pending")
    claimed = property(lambda self: self.root / "claimed")
    acked = property(lambda self: self.root / "acked")
    stale = property(lambda self: self.root / "stale")
    quarantine = property(lambda self: self.root / "quarantine")
    leases = property(lambda self: self.root / "leases")
    producers = property(lambda self: self.root / "producers")
    tmp = property(lambda self: self.root / "tmp")

    def create(self) -> "Spool":
        """Make the directories (private to the user, like the run directory)."""
        for sub in (self.pending, self.claimed, self.acked, self.stale, self.quarantine / ".reasons"):
            sub.mkdir(mode=0o700, parents=True, exist_ok=True)
        for sub in (self.leases, self.producers, self.tmp):
            sub.mkdir(mode=0o700, exist_ok=True)
        os.chmod(self.root, 0o700)
        return self


def names(directory: Path) -> list[str]:
    """Sorted entries of `directory` (oldest group first), skipping dot-names; [] if it is missing."""
    try:
        return sorted(n for n in os.listdir(directory) if not n.startswith("."))
    except FileNotFoundError:
        return []


def count(directory: Path) -> int:
    try:
        with os.scandir(directory) as it:
            return sum(1 for e in it if not e.name.startswith("."))
    except FileNotFoundError:
        return 0


def move(src: Path, dst: Path) -> bool:
    """Rename `src` to `dst`; False when `src` is gone (another process moved it first: it lost the race)."""
    try:
        os.rename(src, dst)
    except FileNotFoundError:
        return False
    return True


def quarantine(spool: Spool, src: Path, reason: str) -> bool:
    """Move a bad file aside with its reason, never deleting it."""
    dst = spool.quarantine / src.name
    if dst.exists():
        dst = dst.with_name(f"{src.name}.{time.time_ns()}")
    if not move(src, dst):
        return False
    atomic_write(spool.quarantine / ".reasons" / f"{dst.name}.txt", reason + "\n")
    get_logger().warning("buffer: quarantined %s: %s", src.name, reason)
    return True


def spool_counts(root: str | Path) -> dict:
    """Groups per state, read from the directories: the audit that `molt-hpc buffer stats` prints."""
    spool = Spool(Path(root))
    claimed_by = {c: count(spool.claimed / c) for c in names(spool.claimed)}
    return {
        "pending": count(spool.pending),
        "claimed": sum(claimed_by.values()),
        "claimed_by": claimed_by,
        "acked": count(spool.acked),
        "stale": count(spool.stale),
        "quarantined": count(spool.quarantine),
        "writing": sum(count(spool.tmp / p) for p in names(spool.tmp)),
    }


def ids_in(directory: Path) -> list[str]:
    """Group ids of the group files in `directory`, oldest first (repeats kept: they are duplicates)."""
    return [p.group_id for n in names(directory) if (p := SpoolName.parse(n)) is not None]


def acked_ids(root: str | Path) -> list[str]:
    """Group ids in the ack ledger, oldest put first; a group consumed twice would appear twice."""
    return ids_in(Spool(Path(root)).acked)


def shm_root(run_dir: str | Path) -> Path:
    """The `/dev/shm` spool of a run: named after the run, its owner's uid, and a hash of its path."""
    run_dir = Path(run_dir).absolute()
    digest = hashlib.sha1(str(run_dir).encode()).hexdigest()[:8]
    return SHM_BASE / f"molt-hpc-{os.getuid()}-{run_dir.name}-{digest}"


def find_spool(run_dir: str | Path) -> Path:
    """The spool of a run: `RUN_DIR/buffer`, or where its `location` pointer says (shm backend)."""
    buffer_dir = Path(run_dir) / "buffer"
    pointer = buffer_dir / LOCATION_FILE
    if pointer.exists():
        return Path(pointer.read_text().strip())
    if (buffer_dir / "removed").exists():  # see buffer/cleanup.py
        raise ValueError(f"the replay buffer of {run_dir} was removed: {(buffer_dir / 'removed').read_text().strip()}")
    if not buffer_dir.is_dir():
        raise ValueError(f"{run_dir} has no replay buffer ({buffer_dir} is missing): pass a run directory")
    return buffer_dir


def stats_lines(run_dir: str | Path) -> list[str]:
    """The lines `molt-hpc buffer stats RUN_DIR` prints: where the spool is, then groups per state."""
    root = find_spool(run_dir)
    if not root.is_dir():
        raise ValueError(f"the replay buffer of {run_dir} points at {root}, which is gone (shm is lost on reboot)")
    c = spool_counts(root)
    by = ", ".join(f"{k}: {v}" for k, v in c["claimed_by"].items() if v)
    lines = [f"buffer       {root}"]
    for state in ("pending", "claimed", "acked", "stale", "quarantined", "writing"):
        lines.append(f"{state:<12} {c[state]}" + (f"  ({by})" if state == "claimed" and by else ""))
    return lines
