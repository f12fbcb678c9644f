"""Launchers: local mode (subprocesses on one machine) and Slurm (one heterogeneous job).

Both start the same `jobs/` entry points.

local.py     `molt-hpc run`: the actor pool under torchrun and the engine pool as local subprocesses
stage.py     the supervised stages (`molt-hpc sft`, `rm train`) in local mode: the actor pool alone
pool.py      the engine pool of one node: its engines and, on the first node, the router and orchestrator
procs.py     the child-process handling both launchers share
torchrun.py  torchrun that leaves SIGTERM to the trainer
watchdog.py  the circuit breaker for a run that stopped training
progress.py  a local run's progress bar or step lines, then a summary, from metrics.jsonl
clean.py     `molt-hpc buffer clean`: a stopped run's shm spool removed, refused while the run is live
elastic.py   `molt-hpc engines add/list/remove`: extra engine pools of a live run, checked before they start
pools.py     the records of extra pools in RUN/pools/, and which of them resume keeps
extra_pool.py  the supervisor process of one local extra pool
preflight/   the checks before any process starts or any job is queued
slurm/       Slurm mode: submit, render, drive and watch one heterogeneous job
"""
