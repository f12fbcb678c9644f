"""The `molt-hpc` command: click routes subcommands to library functions.

Commands never re-declare config fields as flags: a config is a TOML file plus repeatable
`--set dotted.key=value` overrides. Heavy modules (torch, transformers) are imported inside the
commands so `molt-hpc --help` stays fast. User errors (`ValueError`, `ConfigError`) print one
line and exit 2; set MOLT_DEBUG=1 to see their traceback.
"""

import os
import sys

import click

SET_HELP = "Override a config key, e.g. --set algorithm.kl_coef=0.01 (repeatable)."
DEFAULT_CONFIG = "configs/tiny_cpu.toml"


class _Group(click.Group):
    """Turns user errors into one line on stderr and exit code 2."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except ValueError as err:  # ConfigError included: a message for the user, not a bug report
            if os.environ.get("MOLT_DEBUG"):
                raise
            click.echo(f"error: {err}", err=True)
            sys.exit(2)


def _load(config: str | None, overrides: tuple[str, ...]):
    from molt_hpc.config import load_config

    return load_config(config, overrides)


@click.group(cls=_Group)
@click.version_option(package_name="molt-hpc")
def main() -> None:
    """molt-hpc: reinforcement learning for LLMs on Slurm clusters, without Ray."""


@main.command("config")
@click.argument("config", required=False)
@click.option("--set", "overrides", multiple=True, help=SET_HELP)
@click.option("--docs", is_flag=True, help="Write each field's description above it.")
def config_cmd(config: str | None, overrides: tuple[str, ...], docs: bool) -> None:
    """Print the resolved config (CONFIG, or the embedded defaults) as TOML."""
    from molt_hpc.config import to_toml

    click.echo(to_toml(_load(config, overrides), docs=docs), nl=False)


@main.group("model")
def model_group() -> None:
    """Model sources."""


@model_group.command("build-tiny")
@click.argument("out_dir")
@click.option("--config", "config", default=None, help="Take model.tiny (or model.tiny_vl) from this config file.")
@click.option("--set", "overrides", multiple=True, help=SET_HELP)
@click.option("--kind", type=click.Choice(["char", "vl"]), default="char",
              help="char: builtin:tiny-char; vl: builtin:tiny-vl, the tiny vision-language model.")  # fmt: skip
def build_tiny_cmd(out_dir: str, config: str | None, overrides: tuple[str, ...], kind: str) -> None:
    """Write the offline tiny model (tokenizer + random-init weights, HF layout) to OUT_DIR."""
    from molt_hpc.models import build_tiny
    from molt_hpc.models.tiny_vl import build_tiny_vl

    cfg = _load(config, overrides)
    path = build_tiny(out_dir, cfg.model.tiny) if kind == "char" else build_tiny_vl(out_dir, cfg.model.tiny_vl)
    click.echo(f"wrote {path}")


@model_group.command("convert-gguf")
@click.argument("gguf_file")
@click.argument("out_dir")
def convert_gguf_cmd(gguf_file: str, out_dir: str) -> None:
    """Convert a GGUF model file to an HF directory (fp32 safetensors, tokenizer, chat template) at OUT_DIR."""
    from molt_hpc.models.gguf import convert_gguf

    click.echo(f"wrote {convert_gguf(gguf_file, out_dir)}")


@main.command("sample")
@click.argument("config", required=False)
@click.option("--set", "overrides", multiple=True, help=SET_HELP)
@click.option("--prompt", default="hello", help="User message to sample a reply to.")
def sample_cmd(config: str | None, overrides: tuple[str, ...], prompt: str) -> None:
    """Load the configured model and sample one reply (a quick check that a model loads)."""
    from molt_hpc.sample import sample_reply

    click.echo(sample_reply(_load(config, overrides), prompt))


@main.command("run")
@click.argument("config", required=False)
@click.option("--set", "overrides", multiple=True, help=SET_HELP)
@click.option("--resume", "resume_dir", default=None, help="Continue the run in this run directory.")
def run_cmd(config: str | None, overrides: tuple[str, ...], resume_dir: str | None) -> None:
    """Run the whole RL loop on this machine (CONFIG, or the embedded tiny CPU default)."""
    from molt_hpc.launch.local import resume_config, run_local
    from molt_hpc.log import setup_logging

    if resume_dir and config:
        raise click.UsageError("give either CONFIG or --resume RUN_DIR (a resumed run keeps its own config)")
    cfg = resume_config(resume_dir, overrides) if resume_dir else _load(config, overrides)
    setup_logging("launcher", cfg.logging.level)
    sys.exit(run_local(cfg))


@main.command("status")
@click.argument("run_dir")
def status_cmd(run_dir: str) -> None:
    """Where a run is: step, reward trend, throughput, buffer, last checkpoint, processes, Slurm state."""
    from molt_hpc.status import status_lines

    click.echo("\n".join(status_lines(run_dir)))


@main.command("plot")
@click.argument("run_dir")
@click.option("-o", "--out", default=None, help="PNG path (default RUN_DIR/plots/metrics.png).")
def plot_cmd(run_dir: str, out: str | None) -> None:
    """Plot reward, KL and throughput against step and time."""
    from molt_hpc.plot import plot_run

    click.echo(str(plot_run(run_dir, out)))


@main.group("buffer")
def buffer_group() -> None:
    """The replay buffer spool."""


@buffer_group.command("stats")
@click.argument("run_dir")
def buffer_stats_cmd(run_dir: str) -> None:
    """Print the replay buffer's groups per state: pending, claimed, acked, stale, quarantined."""
    from molt_hpc.buffer.spool import stats_lines

    click.echo("\n".join(stats_lines(run_dir)))


@main.command("submit")
@click.argument("config", required=False)
@click.option("--set", "overrides", multiple=True, help=SET_HELP)
@click.option("--dry-run", is_flag=True, help="Print the exact batch script and exit; nothing is created.")
@click.option("--resume", "resume_dir", default=None, help="Submit a new job that continues this run directory.")
def submit_cmd(config: str | None, overrides: tuple[str, ...], dry_run: bool, resume_dir: str | None) -> None:
    """Submit the run as one heterogeneous Slurm job: het group 0 = actor pool, 1 = engine pool."""
    from molt_hpc.launch import slurm
    from molt_hpc.launch.local import resume_config

    if resume_dir and config:
        raise click.UsageError("give either CONFIG or --resume RUN_DIR (a resumed run keeps its own config)")
    cfg = resume_config(resume_dir, overrides) if resume_dir else _load(config, overrides)
    if dry_run:
        click.echo(slurm.dry_run_script(cfg), nl=False)
        return
    job_id, run_dir = slurm.submit(cfg, resume=resume_dir is not None)
    click.echo(f"submitted job {job_id}\nrun directory {run_dir}")


@main.command("sbatch")
@click.argument("config", required=False)
@click.option("--set", "overrides", multiple=True, help=SET_HELP)
@click.option("-o", "--out", required=True, help="Where to write the batch script.")
def sbatch_cmd(config: str | None, overrides: tuple[str, ...], out: str) -> None:
    """Write a standalone batch script of the run, to submit by hand with `sbatch FILE`."""
    from pathlib import Path

    from molt_hpc.launch import slurm

    Path(out).write_text(slurm.standalone_script(_load(config, overrides)))
    click.echo(f"wrote {out}; submit it with: sbatch {out}")


@main.command("cancel")
@click.argument("run_dir")
@click.option("--now", is_flag=True, help="Cancel at once, without waiting for a checkpoint.")
@click.option("--timeout", "timeout_s", type=float, default=None, help="Seconds to wait for the checkpoint.")
def cancel_cmd(run_dir: str, now: bool, timeout_s: float | None) -> None:
    """End a run's Slurm job cleanly: the actor pool checkpoints first (unless --now)."""
    from molt_hpc.launch import slurm

    click.echo(slurm.cancel(run_dir, now=now, timeout_s=timeout_s))
