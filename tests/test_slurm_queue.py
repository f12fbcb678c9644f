"""A job waiting in the queue: `molt-hpc status` says why and when Slurm expects it to start."""

import re

import pytest

from tests.conftest import molt

pytest_plugins = ["tests.slurm_cluster"]
pytestmark = pytest.mark.slurm


def test_status_of_a_pending_job_shows_its_reason_and_expected_start(slurm_cluster, tmp_path, tiny_model_dir) -> None:
    sets = [f"run.root={tmp_path}", "run.name=later", f"model.path={tiny_model_dir}",
            'slurm.actor.extra_sbatch=["--begin=now+1hour"]']  # fmt: skip
    result = molt("submit", "configs/tiny_cpu.toml", *[a for s in sets for a in ("--set", s)])
    assert result.returncode == 0, result.stderr
    job = re.search(r"submitted job (\d+)", result.stdout).group(1)
    try:
        status = molt("status", str(tmp_path / "later"))
        assert status.returncode == 0, status.stderr
        line = next(x for x in status.stdout.splitlines() if x.startswith("slurm:"))
        match = re.fullmatch(
            rf"slurm: job {job} PENDING \(waiting in the queue: reason BeginTime; Slurm expects it to start at (\S+)\)",
            line,
        )
        assert match, line
        assert match.group(1) == slurm_cluster.job_field(job, "StartTime")  # what Slurm itself reports
    finally:
        molt("cancel", str(tmp_path / "later"), "--now")
