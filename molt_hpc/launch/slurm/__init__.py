"""Slurm mode: a run is ONE heterogeneous job (het group 0 = actor pool, het group 1 = engine pool).

job.py        submit, dry-run script, standalone `sbatch` script, cancel: what the CLI calls
checks.py     before submitting: Slurm is reachable, each het group fits its partition
render.py     the batch script rendered from the templates in `slurm/`
executor.py   submitit's executor extended to submit one heterogeneous job
driver.py     the driver: the batch shell on the actor pool's first node, starting both job steps
steps.py      the two job steps (srun commands) and their rendezvous
lifecycle.py  while the job runs: watch both steps; end, requeue or fail the job
state.py      a run directory's job: its id on file, its state as Slurm reports it, the control files
extra.py      an extra engine pool as a Slurm job of its own (`molt-hpc engines add`): submit, state, cancel
"""

from molt_hpc.launch.slurm.job import cancel, dry_run_script, standalone_script, submit

__all__ = ["cancel", "dry_run_script", "standalone_script", "submit"]
