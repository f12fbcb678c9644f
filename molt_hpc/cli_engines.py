"""`molt-hpc engines`: extra engine pools of a live run (`molt_hpc.launch.elastic` does the work).

Click routes; the pool's settings default to the run's own config (`[engines]`, `[slurm]`), and any
other engine setting of the pool is a `--set` override of the run's config, never a flag here.
"""

import click

SET_HELP = "Override a config key for this pool's engines, e.g. --set engines.max_batch=64 (repeatable)."


@click.group("engines")
def engines_group() -> None:
    """Extra engine pools that join (and leave) a live run."""


@engines_group.command("add")
@click.argument("run_dir")
@click.option("--local", is_flag=True, help="Start the pool's engines on this machine instead of in a Slurm job.")
@click.option("--count", type=click.IntRange(min=1), default=None, help="Engines per node (default: the run's).")
@click.option("--kind", default=None, help="Engine kind (default: the run's engines.kind, the one its trainer refits).")
@click.option("--partition", default=None, help="Slurm partition (default: slurm.engines.partition).")
@click.option("--qos", default=None, help="Slurm QOS, e.g. a scavenger one (default: slurm.engines.qos).")
@click.option("--time", "time_limit", default=None, help="Time limit, HH:MM:SS (default: slurm.time).")
@click.option("--gpus-per-node", type=click.IntRange(min=0), default=None, help="Default: slurm.engines.gpus_per_node.")
@click.option("--nodes-per-engine", type=click.IntRange(min=1), default=1, show_default=True,
              help="Nodes of the pool's job (a vLLM engine may span several).")  # fmt: skip
@click.option("--dry-run", is_flag=True, help="Print the pool job's batch script and exit; nothing is created.")
@click.option("--set", "overrides", multiple=True, help=SET_HELP)
def add_cmd(run_dir: str, local: bool, count: int | None, kind: str | None, partition: str | None, qos: str | None,
            time_limit: str | None, gpus_per_node: int | None, nodes_per_engine: int, dry_run: bool,
            overrides: tuple[str, ...]) -> None:  # fmt: skip
    """Add an extra engine pool to the live run in RUN_DIR."""
    from molt_hpc.launch import elastic

    if local:
        if dry_run or partition or qos or time_limit or gpus_per_node is not None or nodes_per_engine != 1:
            raise click.UsageError("--local takes --count, --kind and --set; the other options are a Slurm job's")
        record = elastic.add_local(run_dir, count, kind, overrides)
        click.echo(f"{record.name}: {len(record.indices)} engine(s) {record.indices} registered (pid {record.pid})")
        return
    from molt_hpc.launch.slurm.extra import SlurmPoolSpec

    spec = SlurmPoolSpec(partition, qos, time_limit, gpus_per_node, nodes_per_engine)
    out = elastic.add_slurm(run_dir, count, kind, overrides, spec, dry_run)
    if dry_run:
        click.echo(out, nl=False)
        return
    click.echo(f"{out.name}: submitted job {out.job_id} for engine(s) {out.indices}")


@engines_group.command("list")
@click.argument("run_dir")
def list_cmd(run_dir: str) -> None:
    """Every extra pool of the run: job or pid, engines, versions served, requests, state."""
    from molt_hpc.launch import elastic

    run, _ = elastic.open_run(run_dir)
    from molt_hpc.launch.slurm.extra import slurm_state

    rows = elastic.pool_rows(run, slurm_state)
    if not rows:
        click.echo("no extra pools")
    for r in rows:
        versions = ",".join(map(str, r["versions"])) or "-"
        click.echo(f"{r['pool']:<8} {r['mode']:<5} {r['job']:<12} engines {r['engines']} (in ring {r['in_ring']}) "
                   f"version {versions:<4} requests {r['requests']:<6} {r['state']}")  # fmt: skip


@engines_group.command("remove")
@click.argument("run_dir")
@click.argument("pool")
@click.option("--drain-s", type=float, default=60.0, show_default=True,
              help="Seconds its requests get to finish; the rest continue on the run's other engines.")  # fmt: skip
def remove_cmd(run_dir: str, pool: str, drain_s: float) -> None:
    """Drain and stop the extra pool POOL of the run in RUN_DIR."""
    from molt_hpc.launch import elastic
    from molt_hpc.launch.slurm.extra import cancel

    record = elastic.remove(run_dir, pool, drain_s, cancel=cancel)
    click.echo(f"{record.name}: {record.state}")
