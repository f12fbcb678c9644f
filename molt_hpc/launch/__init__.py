"""Launchers: local mode (subprocesses on one machine) and Slurm (one heterogeneous job).

Both start the same `jobs/` entry points; `procs.py` holds the child-process handling they share.
"""
