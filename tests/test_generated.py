"""Rows without downloads: real reasoning-gym generators written into the run directory, scored by each
task's own scorer through `envs/reasoning_gym.py`, and refused in pre-flight when the task is unknown."""

import json
from pathlib import Path

import pytest

from molt_hpc.agents import State
from molt_hpc.agents.loader import load_agent
from molt_hpc.config import ConfigError, load_config
from molt_hpc.config.generator import GeneratorConfig
from molt_hpc.datasets.generated import generate, materialize, prompt_files
from tests.conftest import ROOT, molt

SMALL = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}


def spec(*tasks: tuple[str, int, int]) -> GeneratorConfig:
    return GeneratorConfig(tasks=[{"name": n, "size": size, "seed": seed, "config": SMALL} for n, size, seed in tasks])


def test_rows_are_a_pure_function_of_the_spec_and_each_seed_is_one_row() -> None:
    a = list(generate(spec(("basic_arithmetic", 20, 0), ("chain_sum", 5, 3))))
    b = list(generate(spec(("basic_arithmetic", 20, 0), ("chain_sum", 5, 3))))
    assert a == b and len(a) == 25
    assert [r["id"] for r in a[:2]] == ["basic_arithmetic-0", "basic_arithmetic-1"] and a[20]["id"] == "chain_sum-3"

    # Row i comes from seed + i: a spec starting 10 seeds later yields the same rows, shifted.
    def seen(rows):  # (the entry's `source_index` counts from the spec's start)
        return [(r["id"], r["prompt"], r["label"]) for r in rows]

    assert seen(generate(spec(("basic_arithmetic", 10, 10)))) == seen(a[10:20])
    for row in a:
        assert row["prompt"].startswith(row["entry"]["question"]) and row["label"] == row["entry"]["answer"]


def test_rows_are_written_once_and_a_changed_spec_is_refused(tmp_path: Path) -> None:
    path = materialize(spec(("basic_arithmetic", 8, 0)), tmp_path / "data" / "train.jsonl")
    first = path.read_text()
    assert len(first.splitlines()) == 8
    path.write_text(first.replace("basic_arithmetic-0", "edited"))  # reused as it is, never regenerated
    assert materialize(spec(("basic_arithmetic", 8, 0)), path).read_text() != first
    with pytest.raises(ValueError, match="generated from another spec"):
        materialize(spec(("basic_arithmetic", 9, 0)), path)


def test_train_and_eval_seeds_must_be_disjoint() -> None:
    gen = "tasks=[{name='chain_sum', size=100, seed=0}]"
    with pytest.raises(ConfigError, match=r"seeds \[0, 100\) and eval.generator seeds \[99, 109\) overlap"):
        load_config(
            None, [f"data.generator={{{gen}}}", "eval.generator={tasks=[{name='chain_sum', size=10, seed=99}]}"]
        )
    cfg = load_config(
        None, [f"data.generator={{{gen}}}", "eval.generator={tasks=[{name='chain_sum', size=10, seed=100}]}"]
    )
    assert cfg.eval.generator.tasks[0].seeds == range(100, 110)


def test_the_shipped_config_generates_disjoint_rows_in_the_run_directory(tmp_path: Path) -> None:
    cfg = load_config(ROOT / "configs" / "tiny_gym_cpu.toml")
    train, held_out = prompt_files(cfg, tmp_path)
    assert train == str(tmp_path / "data" / "train.jsonl") and held_out == str(tmp_path / "data" / "eval.jsonl")
    train_rows = [json.loads(line) for line in Path(train).read_text().splitlines()]
    eval_rows = [json.loads(line) for line in Path(held_out).read_text().splitlines()]
    assert len(train_rows) == 600 and len(eval_rows) == 16
    assert not {r["id"] for r in train_rows} & {r["id"] for r in eval_rows}
    assert prompt_files(cfg, tmp_path) == (train, held_out)  # the second call reads the same files


@pytest.mark.parametrize("task", ["basic_arithmetic", "chain_sum", "simple_equations", "word_sorting"])
def test_the_env_scores_with_the_tasks_own_scorer(task: str) -> None:
    env_cls = load_agent(str(ROOT / "envs" / "reasoning_gym.py"))
    row = next(generate(GeneratorConfig(tasks=[{"name": task, "size": 1, "seed": 7}])))
    extra = {"task": row["task"], "entry": row["entry"]}

    def reward(reply: str) -> tuple[float, dict]:
        result = env_cls().step(State(prompt=row["prompt"], label=row["label"], row=extra, action_text=reply))
        assert result.terminated
        return result.reward, result.info

    assert reward(f"thinking... <answer>{row['label']}</answer>") == (1.0, {"missing_answer": 0.0, "correct": 1.0})
    assert reward("<answer>certainly not this</answer>")[0] < 1.0
    assert reward(str(row["label"])) == (0.0, {"missing_answer": 1.0, "correct": 0.0})  # no tag: no answer


def test_an_unknown_task_fails_preflight_with_one_line(tmp_path: Path) -> None:
    out = molt("run", "configs/tiny_gym_cpu.toml", "--set", f"run.root={tmp_path}",
               "--set", "data.generator={tasks=[{name='basic_arithmetc', size=4}]}")  # fmt: skip
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert "data.generator: unknown reasoning-gym task 'basic_arithmetc'" in lines[0]


def test_the_format_env_adds_its_bonus_to_reward_not_to_score() -> None:
    env_cls = load_agent(str(ROOT / "envs" / "reasoning_gym_format.py"))
    row = next(generate(GeneratorConfig(tasks=[{"name": "basic_arithmetic", "size": 1, "seed": 3}])))
    extra = {"task": row["task"], "entry": row["entry"]}

    def result(reply: str):
        return env_cls().step(State(prompt=row["prompt"], label=row["label"], row=extra, action_text=reply))

    right, wrong, missing = result(f"<answer>{row['label']}</answer>"), result("<answer>x</answer>"), result("x")
    assert (right.reward, right.score) == (1.0, 1.0)
    assert (wrong.reward, wrong.score) == (0.2, 0.0)  # well formed: the bonus, never a pass
    assert (missing.reward, missing.score) == (0.0, 0.0)
