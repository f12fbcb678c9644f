"""A vision-language model before anything starts: `molt-hpc plan` reads `builtin:tiny-vl`'s shape from its
spec, and the pre-flight checks image rows with the model's own tokenizer and image processor.

The plan's counts are checked against the built model's own parameters; the pre-flight's refusals run the real
`molt-hpc run` command (exit 2, one `error:` line, no run directory).
"""

import json
import shutil
from pathlib import Path

import pytest

from molt_hpc.config import MoltConfig, load_config
from molt_hpc.launch.preflight import preflight
from molt_hpc.models import load_causal_lm
from molt_hpc.plan.arch import arch_from_config, arch_of
from tests.conftest import ROOT, molt

CONFIG = ROOT / "configs" / "tiny_vl_cpu.toml"
QUESTION = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour?"}]}]


def test_plan_counts_tiny_vl_from_its_spec(tiny_vl_dir) -> None:
    """The spec's meta build counts what the built model holds: its language blocks as the blocks, the
    vision tower with the rest (tied embeddings once)."""
    spec = MoltConfig().model.tiny_vl
    arch = arch_of(MoltConfig().model.model_copy(update={"path": "builtin:tiny-vl"}))
    model = load_causal_lm(tiny_vl_dir)
    params = {id(p): p.numel() for p in model.parameters()}
    assert arch.params == sum(params.values())
    assert (arch.layers, arch.hidden, arch.vocab, arch.tied) == (spec.num_layers, spec.hidden_size, 108, True)
    visual = sum(p.numel() for p in model.model.visual.parameters())
    assert arch.root_params == sum(params.values()) - sum(b.params for b in arch.blocks) >= visual
    from transformers import Qwen2_5_VLConfig

    big = arch_from_config(Qwen2_5_VLConfig())  # the 72B shape, on the meta device: its 80 language blocks
    assert (big.layers, big.hidden, big.model_type) == (80, 8192, "qwen2_5_vl_text")


def test_preflight_takes_the_colour_task() -> None:
    warnings: list[str] = []
    resolved = preflight(load_config(CONFIG), cwd=ROOT, warn=warnings.append)
    assert warnings == [] and Path(resolved.data.path).is_absolute()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("vl-preflight")
    (base / "data").mkdir()
    shutil.copy(ROOT / "data" / "shapes" / "red-circle-0.png", base / "data" / "red.png")
    rows = {
        "missing.jsonl": {"prompt": QUESTION, "images": ["nope.png"], "label": "red"},
        "two_marks.jsonl": {"prompt": QUESTION, "images": ["red.png", "red.png"], "label": "red"},
        "good.jsonl": {"prompt": QUESTION, "images": ["red.png"], "label": "red"},
    }
    for name, row in rows.items():
        (base / "data" / name).write_text(json.dumps(row) + "\n")
    return base


@pytest.mark.parametrize(
    ("sets", "expected"),
    [
        (["data.path=data/missing.jsonl"], ["data.path", "line 1: bad images", "nope.png"]),
        (["data.path=data/two_marks.jsonl"], ["line 1: bad images", "2 image(s) given but only 1 image part(s)"]),
        (["data.path=data/good.jsonl", "model.path=builtin:tiny-char"], ["need a vision-language model"]),
        (["data.path=data/good.jsonl", "algorithm.advantage=gae"], ["algorithm.advantage = 'gae'", "critic-free"]),
    ],
    ids=["missing-image", "placeholder-count", "text-model", "critic"],
)
def test_bad_image_inputs_fail_before_anything_starts(workdir, sets, expected) -> None:
    args = [
        a
        for s in [
            *sets,
            "run.root=runs",
            "eval.path=data/good.jsonl",
            f"rollout.agent={ROOT / 'envs' / 'color.py'}",
        ]
        for a in ("--set", s)
    ]
    out = molt("run", str(CONFIG), *args, cwd=workdir)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), out.stderr
    for part in expected:
        assert part in lines[0], lines[0]
    assert not (workdir / "runs").exists(), "nothing starts"
