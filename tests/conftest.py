"""Shared fixtures: the repository root, a built tiny model, subprocess helpers."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
"""Test processes side by side (`make test` runs two). Each takes its share of the cores for what it starts:
a stage's trainer otherwise takes every core, and with more busy threads than cores its steps ran several
times slower (the reward-model stage past the 600 s test timeout, against 117 s alone)."""
if WORKERS > 1 and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // WORKERS))


LONGEST = (
    "test_rlhf.py",  # 590-750 s: SFT, reward model, RL with it, and an untrained run, one after the other
    "test_vision_task.py",  # 215-225 s
    "test_vision_two_turn.py",  # 175-215 s
    "test_e2e.py",  # 170-190 s
    "test_e2e_moe.py",  # 170 s
    "test_e2e_resume.py",  # 125-170 s
    "test_e2e_lora.py",  # 145-170 s
    "test_actor_exit.py",  # ~135 s
)
"""The files that take longest (seconds, each alone and serially, on the 2-core machine beside other work),
longest first. The workers take whole files in the collection's order, so a file started late that runs
for minutes ends the run alone while the other worker idles: these start first, the longest at once."""


def pytest_collection_modifyitems(config, items) -> None:
    """The longest files first (`LONGEST`), then the other files with slow tests, then the rest, each in its
    order otherwise: the workers take whole files in this order, so the long ones start together rather
    than end the run alone."""
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    rank = {name: i for i, name in enumerate(LONGEST)}
    items.sort(key=lambda item: (rank.get(item.path.name, len(LONGEST)), item.path not in slow))


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def vllm_gpu_marks() -> list:
    """A module's marks when its tests need vLLM and a GPU: marked `gpu`, skipped without either."""
    import importlib.util

    return [
        pytest.mark.gpu,
        pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (pip install 'molt-hpc[gpu]')"),
        pytest.mark.skipif(gpu_count() < 1, reason="needs a GPU"),
    ]


def molt(*args: str, cwd: Path = ROOT, timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run the installed `molt-hpc` command and capture its output."""
    return subprocess.run(
        [str(BIN / "molt-hpc"), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """The default tiny model, built once per test session."""
    from molt_hpc.config import MoltConfig
    from molt_hpc.models import build_tiny

    out = tmp_path_factory.mktemp("tiny-model")
    return build_tiny(out, MoltConfig().model.tiny)


@pytest.fixture(scope="session")
def tiny_vl_dir(tmp_path_factory) -> Path:
    """The default tiny vision-language model, built once per test session."""
    from molt_hpc.config import MoltConfig
    from molt_hpc.models.tiny_vl import build_tiny_vl

    out = tmp_path_factory.mktemp("tiny-vl")
    return build_tiny_vl(out, MoltConfig().model.tiny_vl)


def shape_png(colour: str = "red", shape: str = "circle", seed: int = 0, side: int = 56) -> bytes:
    """A PNG of the synthetic task's drawing, scaled to `side` pixels."""
    import io

    from molt_hpc.agents.shapes import draw

    out = io.BytesIO()
    draw(colour, shape, seed).resize((side, side)).save(out, format="PNG")
    return out.getvalue()


@pytest.fixture(scope="session")
def tiny_moe_dir(tmp_path_factory) -> Path:
    """The default tiny MoE model (`builtin:tiny-moe`), built once per test session."""
    from molt_hpc.config import MoltConfig
    from molt_hpc.models import build_tiny_moe

    out = tmp_path_factory.mktemp("tiny-moe")
    return build_tiny_moe(out, MoltConfig().model.tiny_moe)


# The rollout test modules' fixtures (test_rollout, test_rollout_migration, test_chat_openai): module-scoped,
# so each module has its own engine pool (a module may kill or restart its engines).
@pytest.fixture(scope="module")
def pool(tmp_path_factory, tiny_model_dir):
    from tests.test_rollout_procs import shared_pool

    return shared_pool(tmp_path_factory.mktemp("pool"), tiny_model_dir)


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from molt_hpc.models import load_tokenizer

    return load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    import torch

    from molt_hpc.models import load_causal_lm

    torch.set_num_threads(1)
    return load_causal_lm(tiny_model_dir)


@pytest.fixture(scope="module")
def dataset(pool, tok):
    from molt_hpc.data import PromptDataset

    return PromptDataset.load(pool.cfg.data, tok, limit=16)
