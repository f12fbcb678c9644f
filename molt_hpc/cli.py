"""The `molt-hpc` command: click routes subcommands to library functions.

Commands never re-declare config fields as flags: a config is a TOML file plus repeatable
`--set dotted.key=value` overrides. Heavy modules (torch, transformers) are imported inside the
commands so `molt-hpc --help` stays fast. User errors (`ValueError`, `ConfigError`) print one
line and exit 2; set MOLT_DEBUG=1 to see their traceback.
"""

import os
import sys

import click

from molt_hpc.cli_engines import engines_group
from molt_hpc.cli_plan import plan_cmd

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


def _preflight(cfg):
    """The pre-flight every launch passes first (molt_hpc.launch.preflight): the config with absolute paths."""
    from molt_hpc.launch.preflight import preflight

    return preflight(cfg)


@click.group(cls=_Group)
@click.version_option(package_name="molt-hpc")
def main() -> None:
    """molt-hpc: reinforcement learning for LLMs on Slurm clusters, without Ray."""


@main.command("config")
@click.argument("config", required=False)
@click.option("--set", "overrides", multiple=True, help=SET_HELP)
@click.option("--docs", is_flag=True, help="Write each field's description above it.")
@click.option("--format", "fmt", type=click.Choice(["toml", "markdown"]), default="toml", show_default=True,
              help="markdown (with --docs): the reference of every config field (docs/config.md).")  # fmt: skip
def config_cmd(config: str | None, overrides: tuple[str, ...], docs: bool, fmt: str) -> None:
    """Print the resolved config (CONFIG, or the embedded defaults) as TOML, or the config reference."""
    from molt_hpc.config import MoltConfig, to_toml

    if fmt == "markdown":
        if not docs or config or overrides:
            raise click.UsageError("--format markdown is the reference of the whole tree: use it with --docs alone")
        from molt_hpc.config.reference import reference_markdown

        click.echo(reference_markdown(MoltConfig), nl=False)
        return
    click.echo(to_toml(_load(config, overrides), docs=docs), nl=False)


@main.group("model")
def model_group() -> None:
    """Model sources."""


@model_group.command("build-tiny")
@click.argument("out_dir")
@click.option("--config", "config", default=None,
              help="Take model.tiny (or model.tiny_moe, model.tiny_vl) from this config file.")  # fmt: skip
@click.option("--moe", is_flag=True, help="Write builtin:tiny-moe (shape from model.tiny_moe) instead of tiny-char.")
@click.option("--vl", is_flag=True, help="Write builtin:tiny-vl (shape from model.tiny_vl), the vision-language model.")
@click.option("--set", "overrides", multiple=True, help=SET_HELP)
def build_tiny_cmd(out_dir: str, config: str | None, moe: bool, vl: bool, overrides: tuple[str, ...]) -> None:
    """Write the offline tiny model (tokenizer + random-init weights, HF layout) to OUT_DIR."""
    from molt_hpc.models import build_tiny, build_tiny_moe
    from molt_hpc.models.tiny_vl import build_tiny_vl

    if moe and vl:
        raise click.UsageError("--moe and --vl each name a model: pass one of them")
    cfg = _load(config, overrides)
    if vl:
        path = build_tiny_vl(out_dir, cfg.model.tiny_vl)
    else:
        path = build_tiny_moe(out_dir, cfg.model.tiny_moe) if moe else build_tiny(out_dir, cfg.model.tiny)
    click.echo(f"wrote {path}")


@model_group.command("convert-gguf")
@click.argument("gguf_file")
@click.argument("out_dir")
def convert_gguf_cmd(gguf_file: str, out_dir: str) -> None:
    """Convert a GGUF model file to an HF directory (fp32 safetensors, tokenizer, chat template) at OUT_DIR."""
    from molt_hpc.models.gguf import convert_gguf

    click.echo(f"wrote {convert_gguf(gguf_file, out_dir)}")


@model_group.command("merge")
@click.argument("source")
@click.argument("out_dir")
@click.option("--base", default=None, help="The base model directory (default: the one the adapters name).")
def merge_cmd(source: str, out_dir: str, base: str | None) -> None:
    """Merge a LoRA run's adapters (SOURCE: its run directory, a checkpoint, or an adapter directory) into
    their base and write the plain HF model to OUT_DIR."""
    from pathlib import Path

    from molt_hpc.actor.lora_merge import merge_adapter

    click.echo(f"wrote {merge_adapter(Path(source), Path(out_dir), Path(base) if base else None)}")


@main.command("sample")
@click.argument("config", required=False)
@click.option("--set", "overrides", multiple=True, help=SET_HELP)
@click.option("--prompt", default="hello", help="User message to sample a reply to.")
def sample_cmd(config: str | None, overrides: tuple[str, ...], prompt: str) -> None:
    """Load the configured model and sample one reply (a quick check that a model loads)."""
    from molt_hpc.sample import sample_reply

    click.echo(sample_reply(_load(config, overrides), prompt))


NO_PLAN_HELP = "Start even when the memory plan says the config does not fit or cannot run."


def _plan_first(cfg, *, local: bool, refuse: bool) -> None:
    """Plan `cfg`; print its one-line verdict when it does not fit, and exit 2 when `refuse`."""
    from molt_hpc.plan import plan_config, verdict_line

    plan, suggestions = plan_config(cfg, local=local)
    if plan.runnable:
        return
    click.echo(verdict_line(plan, suggestions), err=True)
    if refuse:
        click.echo("error: the plan refuses this config; change it, or pass --no-plan to start anyway", err=True)
        sys.exit(2)


@main.command("run")
@click.argument("config", required=False)
@click.option("--set", "overrides", multiple=True, help=SET_HELP)
@click.option("--resume", "resume_dir", default=None, help="Continue the run in this run directory.")
@click.option("--no-plan", is_flag=True, help=NO_PLAN_HELP)
def run_cmd(config: str | None, overrides: tuple[str, ...], resume_dir: str | None, no_plan: bool) -> None:
    """Run the whole RL loop on this machine (CONFIG, or the embedded tiny CPU default)."""
    from molt_hpc.launch.local import resume_config, run_local
    from molt_hpc.log import setup_logging

    if resume_dir and config:
        raise click.UsageError("give either CONFIG or --resume RUN_DIR (a resumed run keeps its own config)")
    cfg = resume_config(resume_dir, overrides) if resume_dir else _load(config, overrides)
    cfg = _preflight(cfg)
    if not no_plan:
        _plan_first(cfg, local=True, refuse=True)
    setup_logging("launcher", cfg.logging.level)
    if cfg.run.stage != "rl":  # an SFT or reward-model config (or run directory): its own launcher
        from molt_hpc.launch.stage import run_stage_local

        sys.exit(run_stage_local(cfg))
    sys.exit(run_local(cfg))


def _load_stage(stage: str, config: str | None, overrides: tuple[str, ...], resume_dir: str | None):
    """The config of a `stage` command: CONFIG with `run.stage` set to it, or a run directory of that stage."""
    from molt_hpc.config import ConfigError
    from molt_hpc.config.load import read_toml
    from molt_hpc.launch.local import resume_config
    from molt_hpc.launch.stage import COMMANDS

    if resume_dir and config:
        raise click.UsageError("give either CONFIG or --resume RUN_DIR (a resumed run keeps its own config)")
    if resume_dir:
        cfg = resume_config(resume_dir, overrides)
        given = cfg.run.stage
    else:
        raw = read_toml(config).get("run", {}) if config else {}
        given = next((o.partition("=")[2].strip().strip("'\"") for o in overrides
                      if o.partition("=")[0].strip() == "run.stage"), raw.get("stage", stage))  # fmt: skip
    if given != stage:
        where = f"run directory {resume_dir}" if resume_dir else "this config"
        raise ConfigError(
            f"{where} is for `{COMMANDS.get(given, given)}` (run.stage = {given!r}), not `{COMMANDS[stage]}`"
        )
    return cfg if resume_dir else _load(config, (*overrides, f"run.stage={stage}"))


def _run_stage(cfg, no_plan: bool) -> None:
    """Pre-flight, the memory plan of the actor pool alone, then the stage on this machine."""
    from molt_hpc.launch.stage import run_stage_local
    from molt_hpc.log import setup_logging

    cfg = _preflight(cfg)
    if not no_plan:
        _plan_first(cfg, local=True, refuse=True)
    setup_logging("launcher", cfg.logging.level)
    sys.exit(run_stage_local(cfg))


@main.command("sft")
@click.argument("config", required=False)
@click.option("--set", "overrides", multiple=True, help=SET_HELP)
@click.option("--resume", "resume_dir", default=None, help="Continue the SFT run in this run directory.")
@click.option("--no-plan", is_flag=True, help=NO_PLAN_HELP)
def sft_cmd(config: str | None, overrides: tuple[str, ...], resume_dir: str | None, no_plan: bool) -> None:
    """Supervised fine-tuning on chat demonstrations ([sft]): the loss on the assistant replies only."""
    _run_stage(_load_stage("sft", config, overrides, resume_dir), no_plan)


@main.group("rm")
def rm_group() -> None:
    """Reward models."""


@rm_group.command("train")
@click.argument("config", required=False)
@click.option("--set", "overrides", multiple=True, help=SET_HELP)
@click.option("--resume", "resume_dir", default=None, help="Continue the reward-model run in this run directory.")
@click.option("--no-plan", is_flag=True, help=NO_PLAN_HELP)
def rm_train_cmd(config: str | None, overrides: tuple[str, ...], resume_dir: str | None, no_plan: bool) -> None:
    """Train a reward model on preference pairs ([rm]): Bradley-Terry; a sequence-classification checkpoint."""
    _run_stage(_load_stage("rm", config, overrides, resume_dir), no_plan)


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


@buffer_group.command("clean")
@click.argument("run_dir")
def buffer_clean_cmd(run_dir: str) -> None:
    """Remove a finished or stopped run's /dev/shm spool (refused while the run is live)."""
    from molt_hpc.launch.clean import clean

    click.echo(clean(run_dir))


def _rl_only(cfg) -> None:
    if cfg.run.stage != "rl":
        raise ValueError(
            f"run.stage = {cfg.run.stage!r}: Slurm jobs run the RL loop; train this stage on a node of an "
            "allocation instead (e.g. `srun --gpus-per-node=N molt-hpc sft CONFIG` with actor.ranks = N)"
        )


@main.command("submit")
@click.argument("config", required=False)
@click.option("--set", "overrides", multiple=True, help=SET_HELP)
@click.option("--dry-run", is_flag=True, help="Print the exact batch script and exit; nothing is created.")
@click.option("--resume", "resume_dir", default=None, help="Submit a new job that continues this run directory.")
@click.option("--no-plan", is_flag=True, help=NO_PLAN_HELP)
@click.option("--balance", is_flag=True, help="Apply the best engine:trainer split of `plan --balance` (its overrides "
              "are recorded in the run's config).")  # fmt: skip
def submit_cmd(
    config: str | None, overrides: tuple[str, ...], dry_run: bool, resume_dir: str | None, no_plan: bool, balance: bool
) -> None:
    """Submit the run as one heterogeneous Slurm job: het group 0 = actor pool, 1 = engine pool.

    The memory plan runs first: a config that does not fit or cannot run is refused (exit 2) with
    its verdict in one line; with --dry-run the verdict is only printed (stderr)."""
    from molt_hpc.launch import slurm
    from molt_hpc.launch.local import resume_config

    if resume_dir and config:
        raise click.UsageError("give either CONFIG or --resume RUN_DIR (a resumed run keeps its own config)")
    cfg = resume_config(resume_dir, overrides) if resume_dir else _load(config, overrides)
    if balance:
        from molt_hpc.plan.balance import apply_best

        cfg, changes = apply_best(cfg, local=False)
        click.echo(f"balance: {' '.join(changes) or 'the config is already the best split'}", err=True)
    _rl_only(cfg)
    if dry_run:  # the script, and the pre-flight's verdict: a job that submit would refuse exits 2 here too
        from molt_hpc.launch.preflight.files import PreflightError

        try:
            cfg, refused = _preflight(cfg), None
        except PreflightError as err:
            refused = err
        if not no_plan and refused is None:  # a refused input is the one line to read; no plan of it
            _plan_first(cfg, local=False, refuse=False)
        click.echo(slurm.dry_run_script(cfg), nl=False)
        if refused is not None:
            raise refused
        return
    cfg = _preflight(cfg)
    from molt_hpc.launch.slurm.checks import check_actor_ranks, check_slurm_reachable

    check_actor_ranks(cfg)  # what the config alone decides first, on any machine
    check_slurm_reachable()  # cheap, and no plan is worth making for a job that cannot be submitted
    if not no_plan:
        _plan_first(cfg, local=False, refuse=True)
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

    cfg = _load(config, overrides)
    _rl_only(cfg)
    Path(out).write_text(slurm.standalone_script(_preflight(cfg)))
    click.echo(f"wrote {out}; submit it with: sbatch {out}")


@main.command("cancel")
@click.argument("run_dir")
@click.option("--now", is_flag=True, help="Cancel at once, without waiting for a checkpoint.")
@click.option("--timeout", "timeout_s", type=float, default=None, help="Seconds to wait for the checkpoint.")
def cancel_cmd(run_dir: str, now: bool, timeout_s: float | None) -> None:
    """End a run's Slurm job cleanly: the actor pool checkpoints first (unless --now, a plain scancel).
    Blocks until the job has ended: at most slurm.stop_timeout_s + 75 s unless --timeout says otherwise."""
    from molt_hpc.launch import slurm

    click.echo(slurm.cancel(run_dir, now=now, timeout_s=timeout_s))


main.add_command(engines_group)
main.add_command(plan_cmd)
