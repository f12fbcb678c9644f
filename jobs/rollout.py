"""Entry point of the rollout orchestrator: `python jobs/rollout.py RUN_DIR`.

Reads the run's resolved config (`RUN_DIR/config.toml`) and runs `molt_hpc.rollout.main.main`; the
heavy imports happen after the arguments are parsed.
"""

import argparse
import os
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run the rollout orchestrator of a run directory.")
    parser.add_argument("run_dir", type=Path, help="the run directory (holds config.toml and rendezvous/)")
    args = parser.parse_args(argv)
    os.umask(0o077)  # private run files (molt_hpc.rundir.private_files says why), before anything is written
    from molt_hpc.config import ConfigError, load_config

    try:
        cfg = load_config(args.run_dir / "config.toml")
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    from molt_hpc.rollout.main import main as rollout_main

    return rollout_main(cfg, args.run_dir)


if __name__ == "__main__":
    code = main()
    from molt_hpc.log import end_process

    # The orchestrator's shutdown has saved its state and stopped its env workers; user threads of an
    # env (`rollout.env_workers = 0`) may still run torch code, so skip the interpreter's teardown.
    end_process(code)
