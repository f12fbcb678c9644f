"""Entry point of the engine pool's processes: `python jobs/engine.py RUN_DIR --role engine --index I`.

Roles: `engine` (one inference engine), `scorer` (a reward-model scorer), `teacher` (a distillation
teacher), `sandbox` (the server that runs untrusted code for envs), `router` (the session-affine router),
`pool` (a node's engines, plus the router, the rollout orchestrator, the scorers, the teachers and the
sandbox on the pool's first node, supervised), `sandboxes` (a Slurm job's het group 2: the sandbox server
alone, supervised), `extra-pool` (the engines of an extra pool a live run took on, `molt-hpc engines add`). Reads the
resolved config from `RUN_DIR/config.toml`; heavy modules are imported after the arguments are parsed.
"""

import argparse
import os
import sys
from pathlib import Path


def run_engine(cfg, run_dir: Path, args: argparse.Namespace) -> int:
    if cfg.engines.kind == "vllm":
        from molt_hpc.engine.vllm.main import main

        return main(cfg, run_dir, args.index, args.engine_node)
    from molt_hpc.engine.main import main

    return main(cfg, run_dir, args.index)


def run_scorer(cfg, run_dir: Path, args: argparse.Namespace) -> int:
    from molt_hpc.scorer import main

    return main(cfg, run_dir, args.index)


def run_teacher(cfg, run_dir: Path, args: argparse.Namespace) -> int:
    from molt_hpc.scorer import teacher_main

    return teacher_main(cfg, run_dir, args.index)


def run_sandbox(cfg, run_dir: Path, args: argparse.Namespace) -> int:
    from molt_hpc.sandbox.server import main

    return main(cfg, run_dir)


def run_router(cfg, run_dir: Path, args: argparse.Namespace) -> int:
    from molt_hpc.router.main import main

    return main(cfg, run_dir)


def run_extra_pool(cfg, run_dir: Path, args: argparse.Namespace) -> int:
    from molt_hpc.launch.extra_pool import run_extra_pool as extra
    from molt_hpc.log import setup_logging
    from molt_hpc.rundir import RunDir

    if not args.pool:
        raise ValueError("--role extra-pool needs --pool NAME")
    setup_logging(args.pool, cfg.logging.level)
    return extra(cfg, RunDir(run_dir), args.pool)


def run_pool(cfg, run_dir: Path, args: argparse.Namespace) -> int:
    from molt_hpc.launch.pool import run_pool as pool
    from molt_hpc.log import setup_logging
    from molt_hpc.rundir import RunDir

    if args.role == "sandboxes":
        setup_logging("sandboxes", cfg.logging.level)
        return pool(cfg, RunDir(run_dir), 0, cfg.engines.max_restarts, role="sandboxes")
    setup_logging(f"pool {args.node_rank}", cfg.logging.level)
    role = "pool-no-sandbox" if args.no_sandbox else "pool"
    return pool(cfg, RunDir(run_dir), args.node_rank, cfg.engines.max_restarts, role=role)


ROLES = {
    "engine": run_engine,
    "router": run_router,
    "pool": run_pool,
    "scorer": run_scorer,
    "teacher": run_teacher,
    "sandbox": run_sandbox,
    "sandboxes": run_pool,
    "extra-pool": run_extra_pool,
}


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="the run directory (holds config.toml and rendezvous/)")
    parser.add_argument("--role", choices=sorted(ROLES), required=True)
    parser.add_argument("--index", type=int, default=0, help="engine, scorer or teacher index (those roles)")
    parser.add_argument(
        "--engine-node", type=int, default=0,
        help="this node's rank in its engine (role engine; 0 serves it, others join it: engines.nodes_per_engine)",
    )  # fmt: skip
    parser.add_argument(
        "--no-sandbox", action="store_true",
        help="role pool: leave the [sandbox] server to the Slurm job's sandbox het group (role sandboxes)",
    )  # fmt: skip
    parser.add_argument("--pool", default=None, help="role extra-pool: the pool's name (RUN_DIR/pools/NAME.json)")
    parser.add_argument(
        "--config", type=Path, default=None,
        help="the resolved config to read instead of RUN_DIR/config.toml (an extra pool's, RUN_DIR/pools/NAME.toml)",
    )  # fmt: skip
    parser.add_argument(
        "--node-rank",
        type=int,
        default=int(os.environ.get("SLURM_NODEID", "0")),
        help="this node's rank in the engine pool (role pool; default $SLURM_NODEID or 0)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    os.umask(0o077)  # private run files (molt_hpc.rundir.private_files says why), before anything is written
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from molt_hpc.config import load_config
    from molt_hpc.rundir import RunDir

    run = RunDir(args.run_dir.absolute())
    if not run.config.is_file():
        raise SystemExit(f"error: {run.config} not found; RUN_DIR must be a run directory with config.toml")
    cfg = load_config(args.config or run.config)
    try:
        return ROLES[args.role](cfg, run.path, args)
    except ValueError as err:  # a user error (config, model, GPU memory): one line with the fix, exit 2
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    code = main()
    from molt_hpc.log import end_process

    # Skip the interpreter's teardown of torch + transformers (seconds, and torch's own threads).
    end_process(code)
