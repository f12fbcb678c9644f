"""submitit's Slurm executor, extended to submit one heterogeneous job (submitit has no het support).

Everything submitit does stays: pickling the callable, the job folder, `job.result()`, requeue on
its signal. Only the batch script changes: it is rendered from `slurm/` with one `#SBATCH hetjob`
component per pool, and python runs as the batch shell itself (`exec`), so the `B:` warning signal
reaches the driver.
"""

import shlex
import sys
from pathlib import Path

import submitit

from molt_hpc.config import MoltConfig
from molt_hpc.config.infra import slurm_time_seconds
from molt_hpc.launch.slurm.render import submitit_script


class HetSlurmExecutor(submitit.SlurmExecutor):
    """Submits a callable as the driver of `cfg`'s heterogeneous job (het group 0 = actor pool)."""

    def __init__(self, folder: str | Path, cfg: MoltConfig, workdir: str | Path, python: str = sys.executable):
        super().__init__(folder, python=f"exec {shlex.quote(python)}")
        self.cfg = cfg
        self.workdir = Path(workdir)
        # submitit's own early-signal handler counts timeouts against this (minutes, rounded up)
        self.update_parameters(time=-(-slurm_time_seconds(cfg.slurm.time) // 60))

    def _make_submission_file_text(self, command: str, uid: str) -> str:
        return submitit_script(self.cfg, self.folder, command, self.workdir)

    def _num_tasks(self) -> int:
        return 1  # one driver in the batch shell, whatever the groups' sizes: one result pickle
