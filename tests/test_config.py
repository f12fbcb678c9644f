"""The config tree: every shipped file parses, overrides apply, and each bad input is one clear line."""

import tomllib
from pathlib import Path

import pytest

from molt_hpc.config import ConfigError, MoltConfig, load_config, to_toml
from molt_hpc.config.infra import slurm_time_seconds
from tests.conftest import ROOT, molt

CONFIGS = sorted((ROOT / "configs").glob("*.toml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_shipped_config_parses(path: Path) -> None:
    cfg = load_config(path)
    assert isinstance(cfg, MoltConfig)


def test_tiny_cpu_is_the_embedded_default() -> None:
    assert load_config(ROOT / "configs/tiny_cpu.toml") == MoltConfig()


def test_toml_round_trip_keeps_every_value() -> None:
    cfg = load_config(None, ["algorithm.kl_coef=0.05", "algorithm.dual_clip=3.0", "slurm.actor.partition=gpu"])
    again = MoltConfig.model_validate(tomllib.loads(to_toml(cfg, docs=True)))
    assert again == cfg


def test_overrides_are_typed_toml_values() -> None:
    cfg = load_config(
        None, ["algorithm.kl_coef=0.01", "run.sync=true", "engines.extra_args=['--a', '--b']", "run.name=abc"]
    )
    assert cfg.algorithm.kl_coef == 0.01
    assert cfg.run.sync is True
    assert cfg.engines.extra_args == ["--a", "--b"]
    assert cfg.run.name == "abc"


def test_every_field_has_a_docstring() -> None:
    def walk(model_cls, prefix=""):
        for name, field in model_cls.model_fields.items():
            assert field.description, f"{prefix}{name} has no docstring"
            sub = getattr(field.annotation, "model_fields", None)
            if sub is not None:
                walk(field.annotation, f"{prefix}{name}.")

    walk(MoltConfig)


def test_slurm_time_formats() -> None:
    assert slurm_time_seconds("90") == 90 * 60
    assert slurm_time_seconds("05:30") == 5 * 60 + 30
    assert slurm_time_seconds("01:00:00") == 3600
    assert slurm_time_seconds("2-03:04:05") == 2 * 86400 + 3 * 3600 + 4 * 60 + 5
    assert slurm_time_seconds("1-02:00") == 86400 + 2 * 3600


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["algorithm.kl_coef=0.1", "rollout.n_samples=1"], "set rollout.n_samples >= 2"),
        (["actor.cp=3", "slurm.actor.gpus_per_node=8"], "does not divide"),
        (["slurm.time=00:01:00", "slurm.signal_lead_s=120"], "slurm.signal_lead_s (120) is not shorter"),
        (["slurm.engines.nodes=0"], "slurm.engines.nodes is 0"),
        (["rollout.max_new_tokens=200"], "exceeds rollout.max_total_tokens"),
        (["model.tiny.num_heads=3"], "must divide model.tiny.hidden_size"),
        (["rollout.admission=kept_share", "run.sync=true"], "set rollout.admission = 'bound', or run.sync = false"),
    ],
)
def test_cross_section_rules(overrides: list[str], expected: str) -> None:
    with pytest.raises(ConfigError, match=None) as info:
        load_config(None, overrides)
    assert expected in str(info.value)


BAD_CASES = {
    "unknown key": (
        "[algorithm]\nkl_coeff = 0.1\n",
        "unknown key 'algorithm.kl_coeff' (did you mean 'algorithm.kl_coef'?)",
    ),
    "unknown section": ("[algorithim]\nkl_coef = 0.1\n", "unknown key 'algorithim' (did you mean 'algorithm'?)"),
    "wrong type": ('[algorithm]\nkl_coef = "lots"\n', "algorithm.kl_coef: Input should be a valid number"),
    "out of range": ("[algorithm]\neps_low = 1.5\n", "algorithm.eps_low: Input should be less than 1 (got 1.5)"),
    "bad choice": ('[algorithm]\nadvantage = "ppo"\n', "algorithm.advantage: Input should be 'grpo', 'dr_grpo'"),
    "missing required": ("[reward_model]\ncombine = 'add'\n", "reward_model.path: required key is missing"),
    "moved section": ("[data.eval]\npath = 'x.jsonl'\n", "[data.eval] is now the top-level [eval] section"),
    "eval k over n": ("[eval]\npath = 'x.jsonl'\nn = 4\nk = [1, 8]\n", "eval.k = [1, 8] has k > eval.n = 4"),
    "eval best metric": ("[eval]\npath = 'x.jsonl'\nbest_metric = 'pass@8'\n", "eval.best_metric = 'pass@8': use one"),
    "invalid toml": ("[run]\nname = \nsteps = 3\n", "invalid TOML"),
    "section rule": (
        "[slurm]\nstop_timeout_s = 200\n",
        "): slurm.stop_timeout_s (200) is not shorter than slurm.signal_lead_s (120): the job would be killed",
    ),
    "value for a section": ("run = 5\n", "run: is a section: write it as a [run] table of keys"),
}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_config_prints_one_line_and_exits_2(case: str, tmp_path: Path) -> None:
    text, expected = BAD_CASES[case]
    path = tmp_path / "bad.toml"
    path.write_text(text)
    result = molt("config", str(path))
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert expected in lines[0]
    assert "Traceback" not in result.stderr and "{" not in lines[0]  # no raw section contents
    if case == "invalid toml":
        assert "line 2" in lines[0]


def test_missing_file_and_bad_override_are_one_line() -> None:
    result = molt("config", "no/such.toml")
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "error: config file no/such.toml not found; configs shipped: " + ", ".join(p.name for p in CONFIGS)
    )
    result = molt("config", "--set", "algorithm.kl_coef")
    assert result.returncode == 2
    assert "write overrides as dotted.key=value" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_resolved_config_prints_and_reparses() -> None:
    result = molt("config", "configs/tiny_cpu.toml", "--set", "actor.lr=0.002")
    assert result.returncode == 0, result.stderr
    assert MoltConfig.model_validate(tomllib.loads(result.stdout)).actor.lr == 0.002
