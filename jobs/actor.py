"""Entry point of the actor pool, run by torchrun on every node: `torchrun --nproc-per-node N
jobs/actor.py RUN_DIR [--resume]` (a local run of one rank runs `jobs/actor.py RUN_DIR` alone).

Reads the resolved config from `RUN_DIR/config.toml`; heavy modules (torch, transformers) are
imported after the arguments are parsed. `--resume` requires a checkpoint to resume from; without
it, `checkpoint.resume` decides (`auto`: resume when the run directory has one). The rank leaves
through `end_process` once its shutdown is done (see `molt_hpc.log.end_process` for why).
"""

import argparse
import os
import signal
import sys
import traceback
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description="One rank of the molt-hpc actor pool (the FSDP2 trainer).")
    parser.add_argument("run_dir", help="the run directory (holds config.toml)")
    parser.add_argument("--resume", action="store_true", help="fail unless the run has a checkpoint to resume from")
    args = parser.parse_args()
    os.umask(0o077)  # private run files (molt_hpc.rundir.private_files says why), before anything is written
    run_dir = Path(args.run_dir)

    from molt_hpc.config import load_config

    try:
        cfg = load_config(run_dir / "config.toml")

        if cfg.run.stage == "rl":
            from molt_hpc.actor.trainer import main as train
        else:  # SFT and reward-model training: the same trainer fed from a dataset
            from molt_hpc.actor.supervised import main as train

        return train(cfg, run_dir, resume=args.resume)
    except ValueError as err:  # a user error (config, model, checkpoint): one line, not a traceback per rank
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 2
    finally:
        # A stop reaches a rank more than once (Slurm signals every process of the step, torchrun passes it
        # on): one that lands while the interpreter shuts down, when Python's handlers are gone, would kill
        # the rank after its good checkpoint. What is left to do here is to exit.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)


def run() -> None:
    try:
        code = main()
    except SystemExit as stop:  # argparse's --help and usage errors
        code = stop.code if isinstance(stop.code, int) else int(stop.code is not None) * 2
    except BaseException:  # the traceback first, then the same clean exit path with a failure code
        traceback.print_exc()
        code = 1
    from molt_hpc.log import end_process

    end_process(code)


if __name__ == "__main__":
    run()
