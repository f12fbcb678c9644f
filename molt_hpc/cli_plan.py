"""`molt-hpc plan`: click routes to `molt_hpc.plan` (the memory and speed plan of a config, before it runs)."""

import sys

import click

SET_HELP = "Override a config key, e.g. --set actor.micro_batch_size=4 (repeatable)."


@click.command("plan")
@click.argument("config", required=False)
@click.option("--set", "overrides", multiple=True, help=SET_HELP)
@click.option("--local/--slurm", "local", default=None,
              help="Plan this machine's placement (molt-hpc run) or the Slurm job's (molt-hpc submit); "
              "default: Slurm when the slurm section asks for GPUs.")  # fmt: skip
@click.option("--balance", is_flag=True, help="Search the engine:trainer GPU split and rollout.groups_in_flight "
              "for the most trained tokens/s; print the best three.")  # fmt: skip
@click.option("--calibrate", is_flag=True, help="Measure this machine's speed profile (a GPU if there is one, "
              "else the CPU) on the config's model; print it as a [plan.cuda] or [plan.cpu] section.")  # fmt: skip
@click.option("--extra-engines", type=click.IntRange(min=1), default=None, help="Also say what an extra pool of "
              "this many engines (molt-hpc engines add) adds: memory, KV cache, refit bytes and time.")  # fmt: skip
def plan_cmd(config: str | None, overrides: tuple[str, ...], local: bool | None, balance: bool, calibrate: bool,
             extra_engines: int | None) -> None:  # fmt: skip
    """Does CONFIG fit, and how fast will it run? Per-GPU memory of each pool by category and phase, KV
    cache, refit, host memory, the predicted step time and what bounds it, a verdict and the changes that
    would make it fit. Exit 0: it fits and can run; 1: not."""
    from molt_hpc.config import load_config
    from molt_hpc.plan import default_local, plan_config, report

    if balance and calibrate:
        raise click.UsageError("--balance plans with a speed profile and --calibrate measures one: pass one of them")
    cfg = load_config(config, overrides)
    if calibrate:
        from molt_hpc.plan.calibrate import calibrate_here

        return click.echo(calibrate_here(cfg))
    local = default_local(cfg) if local is None else local
    if balance:
        from molt_hpc.plan.balance import balance_report

        return click.echo(balance_report(cfg, local=local))
    plan, suggestions = plan_config(cfg, local=local)
    click.echo(report(plan, suggestions))
    if extra_engines:
        from molt_hpc.plan.extra import extra_pool_lines

        click.echo("\n".join(["", *extra_pool_lines(plan, extra_engines)]))
    sys.exit(0 if plan.runnable else 1)
