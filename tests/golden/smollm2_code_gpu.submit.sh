#!/bin/bash
# molt-hpc: one heterogeneous Slurm job, rendered from slurm/het_job.sbatch by `molt-hpc submit`.
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
#SBATCH --output=<ROOT>/runs/smollm2-code/submitit/%j_0_log.out
#SBATCH --error=<ROOT>/runs/smollm2-code/submitit/%j_0_log.err
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

# The driver (molt_hpc.launch.slurm.driver) is this shell's process, so the --signal warning
# (B:USR1) reaches it; submitit loads it from its pickle in the run directory.
export SUBMITIT_EXECUTOR=slurm
export SUBMITIT_PREEMPT_SIGNAL=USR1
exec <PYTHON> -u -m submitit.core._submit <ROOT>/runs/smollm2-code/submitit
