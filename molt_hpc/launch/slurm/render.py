"""The heterogeneous job's batch script, rendered from the templates in `slurm/`.

One frame (`slurm/het_job.sbatch`) holds the `#SBATCH` lines of the het groups (the actor pool, the engine
pool, and with `[sandbox]` the sandbox server's CPU node) and the setup lines;
two launch fragments end it: `launch_submitit.sh` (what `molt-hpc submit` sends through submitit: the
pickled driver) and `launch_driver.sh` (what `molt-hpc sbatch` writes for users who submit by hand:
`jobs/driver.py` fed the resolved config). Everything comes from the validated config; nothing here
queries Slurm or touches the filesystem outside `slurm/`.
"""

import shlex
import string
import sys
from pathlib import Path

from molt_hpc.config import MoltConfig, to_toml
from molt_hpc.config.infra import SlurmGroupConfig
from molt_hpc.launch.procs import REPO

TEMPLATES = REPO / "slurm"
DRIVER = REPO / "jobs" / "driver.py"
WARNING_SIGNAL = "USR1"
"""The time-limit warning; `B:` sends it to the batch shell only, which is the driver process."""
HEREDOC_END = "MOLT_CONFIG"


def sbatch_flag(key: str, value: object = None) -> str:
    return f"#SBATCH --{key}" if value is None else f"#SBATCH --{key}={shlex.quote(str(value))}"


def group_lines(cfg: MoltConfig, group: SlurmGroupConfig) -> list[str]:
    """`#SBATCH` lines of one het group: one task per node (torchrun or the node's engine pool)."""
    sl = cfg.slurm
    pairs = [
        ("job-name", sl.job_name),
        ("partition", group.partition),
        ("nodes", group.nodes),
        ("ntasks-per-node", 1),
        ("cpus-per-task", group.cpus_per_task),
        ("gpus-per-node", group.gpus_per_node or None),
        ("mem", group.mem),
        ("time", sl.time),
        ("account", group.account),
        ("qos", group.qos),
        ("constraint", group.constraint),
    ]
    lines = [sbatch_flag(key, value) for key, value in pairs if value is not None]
    return lines + [f"#SBATCH {option}" for option in group.extra_sbatch]


def job_lines(cfg: MoltConfig, workdir: Path, output: str | None, error: str | None) -> list[str]:
    """Options of the whole job; they go with het group 0, the component the batch shell runs in."""
    sl = cfg.slurm
    lines = [
        sbatch_flag("signal", f"B:{WARNING_SIGNAL}@{sl.signal_lead_s}"),
        sbatch_flag("requeue" if sl.requeue else "no-requeue"),
        sbatch_flag("chdir", workdir),
    ]
    if output is not None:
        lines.append(sbatch_flag("output", output))
    if error is not None:
        lines.append(sbatch_flag("error", error))
    return [*lines, sbatch_flag("open-mode", "append")]  # a requeued job appends to its log


def _template(name: str, **values: object) -> str:
    return string.Template((TEMPLATES / name).read_text()).substitute(values)


def render_frame(
    cfg: MoltConfig,
    *,
    rendered_by: str,
    launch: str,
    workdir: Path,
    output: str | None = None,
    error: str | None = None,
) -> str:
    """The whole script: every group's `#SBATCH` lines, the setup lines, then `launch`."""
    group0 = group_lines(cfg, cfg.slurm.actor) + job_lines(cfg, workdir, output, error)
    group2 = ""
    if cfg.sandbox is not None:
        group2 = "\n".join(
            ["#SBATCH hetjob", "# het group 2: sandbox server", *group_lines(cfg, cfg.slurm.sandboxes), ""]
        )
    setup = ""
    if cfg.slurm.setup:
        setup = "# setup ([slurm] setup)\n" + "\n".join(cfg.slurm.setup) + "\n\n"
    return _template(
        "het_job.sbatch",
        rendered_by=rendered_by,
        group0="\n".join(group0),
        group1="\n".join(group_lines(cfg, cfg.slurm.engines)),
        group2=group2,
        setup=setup,
        launch=launch.rstrip("\n"),
    )


def submitit_command(folder: Path, python: str = sys.executable) -> str:
    """The line submitit's Slurm executor ends the script with (`exec`: python is the batch shell)."""
    return " ".join([f"exec {shlex.quote(python)}", "-u -m submitit.core._submit", shlex.quote(str(folder))])


def submitit_script(cfg: MoltConfig, folder: Path, command: str, workdir: Path) -> str:
    """The script `molt-hpc submit` hands to sbatch (and prints with --dry-run)."""
    from submitit.core.utils import JobPaths

    paths = JobPaths(folder)
    return render_frame(
        cfg,
        rendered_by="submit",
        launch=_template("launch_submitit.sh", command=command),
        workdir=workdir,
        output=str(paths.stdout).replace("%t", "0"),
        error=str(paths.stderr).replace("%t", "0"),
    )


def standalone_script(cfg: MoltConfig, run_dir: Path, workdir: Path, python: str = sys.executable) -> str:
    """The self-contained script `molt-hpc sbatch` writes: the driver gets the resolved config inline."""
    config = to_toml(cfg).rstrip("\n")
    assert HEREDOC_END not in config.splitlines(), "the config would end the here-document early"
    launch = _template(
        "launch_driver.sh",
        python=shlex.quote(python),
        driver=shlex.quote(str(DRIVER)),
        run_dir=shlex.quote(str(run_dir)),
        config=config,
    )
    return render_frame(cfg, rendered_by="sbatch", launch=launch, workdir=workdir)
