#!/bin/bash
# molt-hpc: one heterogeneous Slurm job, rendered from slurm/het_job.sbatch by `molt-hpc sbatch`.
# Het group 0 is the actor pool (this script runs on its first node), het group 1 the engine pool; with a
# [sandbox], het group 2 is the CPU node of the sandbox server.
# Do not edit a rendered copy: change the config's [slurm] section and render again.

# het group 0: actor pool
#SBATCH --job-name=molt-smollm2-code
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=8
#SBATCH --gpus-per-node=1
#SBATCH --time=00:30:00
#SBATCH --signal=B:USR1@120
#SBATCH --requeue
#SBATCH --chdir=<ROOT>
#SBATCH --open-mode=append
#SBATCH hetjob
# het group 1: engine pool
#SBATCH --job-name=molt-smollm2-code
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=8
#SBATCH --gpus-per-node=1
#SBATCH --time=00:30:00
#SBATCH hetjob
# het group 2: sandbox server
#SBATCH --job-name=molt-smollm2-code
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=8
#SBATCH --time=00:30:00

# The driver (jobs/driver.py) is this shell's process, so the --signal warning (B:USR1) reaches it.
# It writes the run directory from the resolved config below on the first start and reuses it on
# every requeue.
exec <PYTHON> -u <ROOT>/jobs/driver.py <ROOT>/runs/smollm2-code --config - <<'MOLT_CONFIG'
<CONFIG>
MOLT_CONFIG
