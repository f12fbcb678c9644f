"""A real local Slurm cluster for tests: munged, slurmctld and several slurmd "nodes" on this host.

Everything lives in one temporary directory (config, keys, state, logs, pid files) and nothing in
/etc is read. A heterogeneous job needs one node per component, so the cluster has `nodes` slurmd
daemons (`node0`, `node1`, ...), each on its own port; CPUs are the only consumable resource.
Partitions: `debug` (default, all nodes but the last two) and `train` (the last two, for a long run
that must not share nodes with short tests); both are preempted by partition `urgent` (REQUEUE mode:
the victim gets its `--signal` at once, then TERM after `GraceTime`).

Test modules use the session fixture with `pytest_plugins = ["tests.slurm_cluster"]`; it is skipped
(with the reason) when the Slurm or munge binaries are missing or the tests do not run as root.
Settings chosen for fast tests: `cred_expire=5` (a requeued job may start again after 5 s, not 120),
`SlurmdTimeout=30` (node pings wake the backfill scheduler, which alone restarts requeued het jobs),
`KillWait=30` (Slurm's default: the seconds between SIGTERM and SIGKILL in which a cancelled or
requeued job checkpoints; on this loaded 2-core machine the stop of a stand-in job takes up to ~5 s),
`preempt_send_user_signal` (a preempted job gets its `--signal` at once). slurmctld checks
time limits every 30 s (compiled in, no slurm.conf setting), so warnings come up to 30 s early and
the kill up to 30 s late; `OverTimeLimit=0` kills at the limit itself. A test ends a running job by
its time limit with `scontrol update JobId=J TimeLimit=0` (its end becomes now): the next check sends
the warning, then SIGTERM (SIGKILL `KillWait` later), and the job ends as TIMEOUT.
"""

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

BINARIES = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "srun", "squeue", "scontrol", "sinfo", "scancel")
GRACE_S = 20
CPUS_PER_NODE = 4

SLURM_CONF = """\
ClusterName=local
SlurmctldHost=localhost
SlurmctldPort={port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={base}/munge/munge.sock,cred_expire=5
StateSaveLocation={base}/state
SlurmdSpoolDir={base}/spool/%n
SlurmctldPidFile={base}/run/slurmctld.pid
SlurmdPidFile={base}/run/slurmd.%n.pid
SlurmctldLogFile={base}/log/slurmctld.log
SlurmdLogFile={base}/log/slurmd.%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
MailProg=/bin/true
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
SchedulerParameters=sched_interval=2,bf_interval=2
MessageTimeout=10
SlurmdTimeout=30
InactiveLimit=0
KillWait=30
MinJobAge=600
OverTimeLimit=0
JobRequeue=1
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
SlurmctldParameters=preempt_send_user_signal
"""


def _free_port_block(n: int) -> int:
    """The first of `n` consecutive TCP ports on 127.0.0.1 that are free right now."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            first = s.getsockname()[1]
        if first + n >= 65535:
            continue
        socks = []
        try:
            for port in range(first, first + n):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", port))
            return first
        except OSError:  # a port of the block is taken: try another block
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError("no block of free ports found")


def _alive(pid: int) -> bool:
    """True while `pid` runs; a zombie (exited, not yet reaped by init) counts as stopped."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


@dataclass
class LocalSlurm:
    """One local cluster in `base`; `start()` brings it up, `stop()` ends every process it started."""

    base: Path
    nodes: int = 6
    port: int = 0
    env: dict[str, str] = field(default_factory=dict)

    @property
    def conf(self) -> Path:
        return self.base / "etc" / "slurm.conf"

    @property
    def node_names(self) -> list[str]:
        return [f"node{i}" for i in range(self.nodes)]

    def start(self) -> None:
        self.port = self.port or _free_port_block(self.nodes + 1)
        for sub in ("etc", "munge", "state", "run", "log", *(f"spool/{n}" for n in self.node_names)):
            (self.base / sub).mkdir(parents=True, exist_ok=True)
        self._write_conf()
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        key, m = self.base / "munge" / "munge.key", self.base / "munge"
        if not key.exists():
            subprocess.run(["mungekey", "--create", f"--keyfile={key}"], check=True, capture_output=True)
        try:
            self._run("munged", "--force", f"--key-file={key}", f"--socket={m}/munge.sock",
                      f"--pid-file={self.base}/run/munged.pid", f"--seed-file={m}/munged.seed",
                      f"--log-file={self.base}/log/munged.log")  # fmt: skip
            self._run("slurmctld", "-c", "-f", str(self.conf))
            for name in self.node_names:
                self._run("slurmd", "-f", str(self.conf), "-N", name)
            self.wait_for(self._all_nodes_up, timeout=60, what="all slurmd nodes idle")
        except BaseException:  # a failed start must not leave daemons behind
            self.stop()
            raise

    def _write_conf(self) -> None:
        host = socket.gethostname().split(".")[0]
        lines = [SLURM_CONF.format(port=self.port, base=self.base)]
        for i, name in enumerate(self.node_names):
            lines.append(
                f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={self.port + 1 + i} "
                f"CPUs={CPUS_PER_NODE} RealMemory=4096 State=UNKNOWN"
            )
        debug, train = self.node_names[:-2], self.node_names[-2:]
        for name, nodes in (("debug", debug), ("train", train)):
            default = " Default=YES" if name == "debug" else ""
            lines.append(f"PartitionName={name} Nodes={','.join(nodes)}{default} PriorityTier=1 GraceTime={GRACE_S}")
        lines.append(f"PartitionName=urgent Nodes={','.join(self.node_names)} PriorityTier=10 PreemptMode=OFF")
        self.conf.write_text("\n".join(lines) + "\n")
        (self.base / "etc" / "cgroup.conf").write_text("CgroupPlugin=autodetect\nIgnoreSystemd=yes\n")

    def _run(self, *cmd: str) -> None:
        subprocess.run(cmd, env=self.env, check=True, capture_output=True, timeout=30)

    def slurm(self, *cmd: str, check: bool = True) -> str:
        """Run a Slurm client command against this cluster and return its stdout."""
        out = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=30)
        if check and out.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed: {out.stderr.strip()}")
        return out.stdout

    def _all_nodes_up(self) -> bool:
        out = self.slurm("sinfo", "-h", "-N", "-o", "%N %t", check=False)
        up = {line.split()[0] for line in out.splitlines() if line.split()[1:2] in (["idle"], ["mix"], ["alloc"])}
        return len(up) >= self.nodes

    @staticmethod
    def wait_for(cond: Callable[[], object], timeout: float, what: str, interval: float = 0.2) -> object:
        """Poll `cond` until it returns something truthy; fail with `what` after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = cond()
            if value:
                return value
            time.sleep(interval)
        raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")

    # -- jobs -------------------------------------------------------------------------------

    def job_states(self, job_id: str) -> list[str]:
        """States of a job's components (`[]` once it left squeue)."""
        out = self.slurm("squeue", "-h", "-j", str(job_id), "-o", "%T", check=False)
        return out.split()

    def job_field(self, job_id: str, key: str) -> str | None:
        """One `scontrol show job` field of the job (the leader component)."""
        out = self.slurm("scontrol", "-o", "show", "job", str(job_id), check=False)
        for token in out.splitlines()[0].split() if out else []:
            name, _, value = token.partition("=")
            if name == key:
                return value
        return None

    def component_nodes(self, job_id: str) -> list[str]:
        """NodeList of each het component of a job, in component order."""
        out = self.slurm("scontrol", "-o", "show", "job", str(job_id), check=False)
        lines = [dict(t.partition("=")[::2] for t in line.split()) for line in out.splitlines()]
        lines.sort(key=lambda f: int(f.get("HetJobOffset", 0)))
        return [f.get("NodeList", "") for f in lines]

    def kick(self, job_id: str) -> None:
        """Make the scheduler look at a pending requeued het job now.

        Only backfill starts het jobs and it skips cycles in which nothing changed, so on an idle test
        cluster a requeued het job waits for the next node ping (~15 s); any job update is an event.
        """
        self.slurm("scontrol", "update", f"jobid={job_id}", "comment=requeued", check=False)

    def wait_end(self, job_id: str, timeout: float) -> str:
        """Wait until the job has left the queue (kicking it when requeued); its final JobState."""

        def ended() -> bool:
            states = self.job_states(job_id)
            if states and states[0] == "PENDING" and self.job_field(job_id, "Restarts") not in (None, "0"):
                self.kick(job_id)
            return not states

        self.wait_for(ended, timeout, f"job {job_id} to end", interval=0.5)
        return self.job_field(job_id, "JobState") or "UNKNOWN"

    # -- stop -------------------------------------------------------------------------------

    def stop(self) -> None:
        """Cancel every job, stop the daemons by pid file, kill leftovers of our job steps."""
        if shutil.which("scancel") and (self.base / "run" / "slurmctld.pid").exists():
            self.slurm("scancel", "--user=root", check=False)
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and self.slurm("squeue", "-h", check=False).strip():
                time.sleep(0.2)
        self._kill_job_processes()
        pids = [self._pid(f"slurmd.{n}") for n in self.node_names] + [self._pid("slurmctld")]
        self._terminate([p for p in pids if p])
        munged = self._pid("munged")
        self._terminate([munged] if munged else [])

    def _pid(self, name: str) -> int | None:
        path = self.base / "run" / f"{name}.pid"
        try:
            return int(path.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def _kill_job_processes(self) -> None:
        """KILL slurmstepd of this cluster and all their descendants (they ignore TERM)."""
        marker = f"SLURM_CONF={self.conf}".encode()
        for environ in Path("/proc").glob("[0-9]*/environ"):
            pid = int(environ.parent.name)
            try:
                is_stepd = (environ.parent / "comm").read_text().strip() == "slurmstepd"
                ours = is_stepd and marker in environ.read_bytes()
            except OSError:
                continue
            if ours:
                tree, i = [pid], 0
                while i < len(tree):
                    tree.extend(_children(tree[i]))
                    i += 1
                for p in tree:
                    with contextlib.suppress(ProcessLookupError):  # it already exited
                        os.kill(p, signal.SIGKILL)

    @staticmethod
    def _terminate(pids: list[int], wait_s: float = 10) -> None:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):  # it already exited
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.1)
        for pid in pids:
            if _alive(pid):
                with contextlib.suppress(ProcessLookupError):  # it already exited
                    os.kill(pid, signal.SIGKILL)


def missing_requirements() -> str | None:
    """Why a local cluster cannot start here, or None."""
    missing = [b for b in BINARIES if shutil.which(b) is None]
    if missing:
        return (
            f"Slurm/munge binaries missing: {', '.join(missing)} (apt-get install slurmctld slurmd slurm-client munge)"
        )
    if os.geteuid() != 0:
        return "the local Slurm cluster runs its daemons and jobs as root"
    return None


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory) -> Iterator[LocalSlurm]:
    """A started local cluster; `SLURM_CONF` in os.environ points at it for the session."""
    reason = missing_requirements()
    if reason:
        pytest.skip(reason)
    cluster = LocalSlurm(tmp_path_factory.mktemp("slurm"))
    cluster.start()
    old_term = signal.signal(signal.SIGTERM, _interrupt)  # a killed session still stops its daemons
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(cluster.conf)
    try:
        yield cluster
    finally:
        cluster.stop()
        signal.signal(signal.SIGTERM, old_term)
        if old is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = old


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}: stopping the local Slurm cluster")
