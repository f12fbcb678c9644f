# The driver (molt_hpc.launch.slurm.driver) is this shell's process, so the --signal warning
# (B:USR1) reaches it; submitit loads it from its pickle in the run directory.
export SUBMITIT_EXECUTOR=slurm
export SUBMITIT_PREEMPT_SIGNAL=USR1
${command}
