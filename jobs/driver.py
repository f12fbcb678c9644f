"""Entry point of the Slurm driver in a hand-submitted batch script (`molt-hpc sbatch` writes one).

    python jobs/driver.py RUN_DIR [--config - | --config FILE]

`--config` gives the resolved config (TOML; `-` reads stdin): the run directory is written from it
first. `molt-hpc submit` runs the same driver through submitit (molt_hpc.launch.slurm.driver).
"""

import argparse
import os
import signal
import sys

# The warning and preemption signals wait (blocked, not lost) until the driver's handlers are in place.
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1, signal.SIGTERM})


def main() -> int:
    parser = argparse.ArgumentParser(description="Drive one heterogeneous Slurm job of a molt-hpc run.")
    parser.add_argument("run_dir", help="the run directory")
    parser.add_argument(
        "--config", default=None, help="resolved config TOML to write the run directory from ('-': stdin)"
    )
    args = parser.parse_args()
    os.umask(0o077)  # private run files (molt_hpc.rundir.private_files says why), before anything is written
    text = None
    if args.config == "-":
        text = sys.stdin.read()
    elif args.config is not None:
        with open(args.config) as f:
            text = f.read()

    from molt_hpc.launch.slurm.driver import main as drive_main

    return drive_main(args.run_dir, text)


if __name__ == "__main__":
    sys.exit(main())
