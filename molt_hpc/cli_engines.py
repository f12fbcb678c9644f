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
@click.option("--local", is_flag=True, help="Start the pool's engines on this machine (default: a Slurm job).")
@click.option("--count", type=click.IntRange(min=1), default=None, help="Engines per node (default: the run's).")
@click.option("--kind", default=None, help="Engine kind (default: the run's engines.kind, the one its trainer refits).")
@click.option("--set", "overrides", multiple=True, help=SET_HELP)
def add_cmd(run_dir: str, local: bool, count: int | None, kind: str | None, overrides: tuple[str, ...]) -> None:
    """Add an extra engine pool to the live run in RUN_DIR."""
    from molt_hpc.launch import elastic

    if not local:
        raise click.UsageError("only --local pools are supported by this command so far")
    record = elastic.add_local(run_dir, count, kind, overrides)
    click.echo(f"{record.name}: {len(record.indices)} engine(s) {record.indices} registered (pid {record.pid})")


@engines_group.command("list")
@click.argument("run_dir")
def list_cmd(run_dir: str) -> None:
    """Every extra pool of the run: job or pid, engines, versions served, requests, state."""
    from molt_hpc.launch import elastic

    run, _ = elastic.open_run(run_dir)
    rows = elastic.pool_rows(run)
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

    record = elastic.remove(run_dir, pool, drain_s)
    click.echo(f"{record.name}: {record.state}")
