"""The rendered batch scripts (golden files + their `#SBATCH` lines recomputed from each config), the
checks made before submission, and the step commands the driver builds. No Slurm cluster needed.

Golden files: `tests/golden/<config>.submit.sh` (what `molt-hpc submit --dry-run` prints) and
`<config>.sbatch.sh` (what `molt-hpc sbatch` writes), with the checkout path as `<ROOT>`, the
interpreter as `<PYTHON>` and the embedded config as `<CONFIG>`. After an intended change, re-record
them with `MOLT_GOLDEN_UPDATE=1 .venv/bin/pytest tests/test_slurm_render.py` and review the diff.
"""

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from molt_hpc.config import load_config, to_toml
from molt_hpc.config.infra import slurm_time_seconds
from molt_hpc.config.load import validate
from molt_hpc.launch import slurm
from molt_hpc.launch.preflight import preflight
from molt_hpc.launch.slurm.checks import check_partitions, gpus_in_gres, parse_sinfo
from molt_hpc.launch.slurm.render import HEREDOC_END
from molt_hpc.launch.slurm.state import slurm_job_state
from molt_hpc.launch.slurm.steps import actor_command, engine_command, procs_per_node
from tests.conftest import ROOT, molt

GOLDEN = ROOT / "tests" / "golden"
# Slurm jobs run the RL loop: the SFT and reward-model configs (run.stage) have no job script.
CONFIGS = sorted(p for p in (ROOT / "configs").glob("*.toml") if load_config(p).run.stage == "rl")
HEREDOC = re.compile(rf"<<'{HEREDOC_END}'\n(.*?)\n{HEREDOC_END}\n", re.S)


def normalize(text: str) -> str:
    return text.replace(sys.executable, "<PYTHON>").replace(str(ROOT), "<ROOT>")


def embedded_config(script: str) -> str:
    match = HEREDOC.search(script)
    assert match, "the standalone script has no embedded config"
    return match.group(1)


def check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("MOLT_GOLDEN_UPDATE"):
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
        pytest.skip(f"re-recorded {path.relative_to(ROOT)}")
    assert path.exists(), f"no golden file {path}; record it with MOLT_GOLDEN_UPDATE=1 (see this module's docstring)"
    assert text == path.read_text(), f"{name} differs from its golden file; re-record if the change is intended"


@pytest.fixture
def in_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # the scripts name the submit directory and the run directory under it


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.stem)
def test_submit_script_matches_golden(config: Path, in_root) -> None:
    check_golden(f"{config.stem}.submit.sh", normalize(slurm.dry_run_script(load_config(config))))


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.stem)
def test_standalone_script_matches_golden_and_embeds_the_resolved_config(config: Path, in_root) -> None:
    cfg = load_config(config)
    script = slurm.standalone_script(cfg)
    inline = embedded_config(script)
    assert inline == to_toml(cfg).rstrip("\n")
    assert validate(tomllib.loads(inline), "inline") == cfg
    check_golden(f"{config.stem}.sbatch.sh", normalize(script.replace(inline, "<CONFIG>")))


def sbatch_groups(script: str) -> list[dict[str, str | None]]:
    """The `#SBATCH --key[=value]` options of each het component, in order."""
    groups: list[dict[str, str | None]] = [{}]
    for line in script.splitlines():
        if line == "#SBATCH hetjob":
            groups.append({})
        elif line.startswith("#SBATCH --"):
            key, sep, value = line.removeprefix("#SBATCH --").partition("=")
            groups[-1][key] = value if sep else None
    return groups


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.stem)
def test_sbatch_lines_follow_the_slurm_section(config: Path, in_root) -> None:
    cfg = load_config(config)
    for script in (slurm.dry_run_script(cfg), slurm.standalone_script(cfg)):
        actor, engines, *boxes = sbatch_groups(script)
        groups = [(actor, cfg.slurm.actor), (engines, cfg.slurm.engines)]
        assert len(boxes) == (cfg.sandbox is not None)  # het group 2 exists for a [sandbox] alone
        groups += [(opts, cfg.slurm.sandboxes) for opts in boxes]
        for opts, group in groups:
            assert opts["nodes"] == str(group.nodes)
            assert opts["ntasks-per-node"] == "1"
            assert opts["cpus-per-task"] == str(group.cpus_per_task)
            assert opts.get("gpus-per-node") == (str(group.gpus_per_node) if group.gpus_per_node else None)
            assert opts.get("partition") == group.partition
            assert opts.get("account") == group.account
            assert opts.get("mem") == group.mem
            assert slurm_time_seconds(opts["time"]) == slurm_time_seconds(cfg.slurm.time)
            assert all(f"#SBATCH {extra}" in script for extra in group.extra_sbatch)
        assert actor["signal"] == f"B:USR1@{cfg.slurm.signal_lead_s}"
        assert ("requeue" if cfg.slurm.requeue else "no-requeue") in actor
        assert actor["chdir"] == str(ROOT)
        assert "signal" not in engines and "output" not in engines  # job-wide options go with group 0
        assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0


def test_dry_run_prints_the_script_and_creates_nothing(tmp_path: Path, in_root, tiny_model_dir) -> None:
    model = f"model.path={tiny_model_dir}"
    # --no-plan: the plan reads the 405B shape from model.architecture, which the tiny model is not
    result = molt("submit", "configs/405b_moe.toml", "--set", f"run.root={tmp_path}/runs", "--set", model,
                  "--dry-run", "--no-plan")  # fmt: skip
    assert result.returncode == 0, result.stderr
    cfg = load_config(ROOT / "configs" / "405b_moe.toml", [f"run.root={tmp_path}/runs", model])
    assert result.stdout == slurm.dry_run_script(cfg)
    assert list(tmp_path.iterdir()) == []
    # The shipped placeholder model path: the same script, and the pre-flight's refusal that submit would give.
    placeholder = molt(
        "submit", "configs/405b_moe.toml", "--set", f"run.root={tmp_path}/runs", "--dry-run", "--no-plan"
    )
    assert placeholder.returncode == 2 and placeholder.stdout == result.stdout
    assert placeholder.stderr.startswith("error: model.path = '/path/to/your/405b-moe-hf-checkpoint'")
    assert list(tmp_path.iterdir()) == []


def test_sbatch_command_writes_the_standalone_script(tmp_path: Path, in_root, tiny_model_dir) -> None:
    out = tmp_path / "job.sh"
    result = molt("sbatch", "configs/8b_dense.toml", "--set", f"model.path={tiny_model_dir}", "-o", str(out))
    assert result.returncode == 0, result.stderr
    cfg = load_config(ROOT / "configs" / "8b_dense.toml", [f"model.path={tiny_model_dir}"])
    assert out.read_text() == slurm.standalone_script(preflight(cfg))
    inline = load_config(None).model_validate(tomllib.loads(embedded_config(out.read_text())))
    # Relative paths were resolved where the command ran: the job finds the same files from anywhere.
    assert inline.data.path == str(ROOT / "data" / "math_train.jsonl")
    assert inline.rollout.agent == str(ROOT / "envs" / "math.py")
    assert inline.run.root == str(ROOT / "runs") and inline.slurm.actor_script == str(ROOT / "jobs" / "actor.py")


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("slurm.engines.nodes=0", "slurm.engines.nodes is 0"),
        ("slurm.time=00:01:00", "signal_lead_s (120) is not shorter than slurm.time"),
        ("slurm.stop_timeout_s=200", "stop_timeout_s (200) is not shorter than slurm.signal_lead_s"),
        ('slurm.actor.extra_sbatch=["exclusive"]', "is not one sbatch option"),
    ],
)
def test_bad_slurm_config_is_refused_before_anything_exists(tmp_path: Path, override: str, message: str) -> None:
    result = molt("submit", "--set", f"run.root={tmp_path}", "--set", override)
    assert result.returncode == 2
    assert message in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_submit_without_sbatch_on_path_says_where_to_run(tmp_path: Path) -> None:
    result = molt("submit", "--set", f"run.root={tmp_path}", env={"PATH": str(tmp_path / "empty")})
    assert result.returncode == 2
    assert "sbatch is not on PATH" in result.stderr
    assert list(tmp_path.iterdir()) == []


SINFO = """\
gpu*|16|128|gpu:h100:8(S:0-1)
gpu*|4|64+|gpu:h100:4,nvme:1
cpu|32|192|(null)
"""


def test_sinfo_partitions_are_summed_over_node_kinds() -> None:
    parts = parse_sinfo(SINFO)
    assert (parts["gpu"].nodes, parts["gpu"].cpus_per_node, parts["gpu"].gpus_per_node) == (20, 128, 8)
    assert parts["gpu"].default and not parts["cpu"].default
    assert (parts["cpu"].nodes, parts["cpu"].gpus_per_node) == (32, 0)
    assert [gpus_in_gres(g) for g in ("gpu:8", "gpu:a100:4(S:0),gpu:a100:2", "(null)", "nvme:1")] == [8, 4, 0, 0]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["slurm.actor.gpus_per_node=16"],
            "slurm.actor.gpus_per_node = 16 but the nodes of partition 'gpu' have at most 8",
        ),
        (["slurm.engines.partition=cpu", "slurm.engines.gpus_per_node=1"], "partition 'cpu' have at most 0 GPUs"),
        (["slurm.engines.cpus_per_task=256"], "slurm.engines.cpus_per_task = 256"),
        (["slurm.actor.partition=big"], "'big' is not a partition of this cluster (sinfo lists: cpu, gpu)"),
        (["slurm.actor.nodes=12", "slurm.engines.nodes=9"], "needs 21 nodes of partition 'gpu'"),
    ],
)
def test_groups_must_fit_their_partition(overrides: list[str], message: str) -> None:
    cfg = load_config(None, ["slurm.actor.partition=gpu", *overrides])
    with pytest.raises(ValueError, match=re.escape(message)):
        check_partitions(cfg, parse_sinfo(SINFO))
    check_partitions(load_config(None), parse_sinfo(SINFO))  # the defaults fit the default partition


def test_step_commands_follow_the_config(tmp_path: Path) -> None:
    cfg = load_config(ROOT / "configs" / "405b_moe.toml")
    nodes = ["gpu001", "gpu002", "gpu003", "gpu004"]
    cmd = actor_command(cfg, tmp_path, nodes, "10.0.0.1:29500", "77")
    assert cmd[:2] == ["srun", "--het-group=0"] and "--nodes=4" in cmd and "--gpus-per-node=8" in cmd
    assert "--nnodes=4" in cmd and "--nproc-per-node=8" in cmd and "--rdzv-endpoint=10.0.0.1:29500" in cmd
    assert cmd[-2:] == [str(ROOT / "jobs" / "actor.py"), str(tmp_path)]
    pool = engine_command(cfg, tmp_path, nodes[:2])
    assert pool[:2] == ["srun", "--het-group=1"] and "--nodes=2" in pool
    assert pool[-4:] == [str(ROOT / "jobs" / "engine.py"), str(tmp_path), "--role", "pool"]
    cpu = load_config(None, ["actor.ranks=4", "slurm.actor.nodes=2"])
    assert procs_per_node(cpu) == 2 and procs_per_node(cfg) == 8


def test_cpu_actor_ranks_must_spread_evenly_over_the_nodes(tmp_path: Path) -> None:
    result = molt("submit", "--set", f"run.root={tmp_path}", "--set", "actor.ranks=3", "--set", "slurm.actor.nodes=2")
    assert result.returncode == 2 and "actor.ranks = 3 does not spread evenly" in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_no_job_on_record_has_no_slurm_state(tmp_path: Path) -> None:
    assert slurm_job_state(tmp_path) is None
