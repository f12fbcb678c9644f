"""The sandbox in a whole run (`molt-hpc run configs/tiny_code_cpu.toml`): the engine pool starts the sandbox
server, env workers reach it as `state.sandbox`, hostile code in every sample fails inside it, and the run
goes on to its last step with the same server and its whole pool.

The policy (the tiny character model) cannot write Python, so the agent here scores the row's reference
solution with the shipped code env's harness instead of the model's reply, and runs a fork bomb beside it:
every sample's reward is 1 exactly when the reference passed and the bomb failed. Real processes
throughout: the launcher, the trainer, the engine pool, the sandbox server with bubblewrap.
"""

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from molt_hpc.log import read_metrics
from tests.conftest import BIN, ROOT

pytestmark = [pytest.mark.slow, pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap")]

AGENT = """
import importlib.util

from molt_hpc.agents import Env, Result

spec = importlib.util.spec_from_file_location("shipped_code_env", {code_env!r})
shipped = importlib.util.module_from_spec(spec)
spec.loader.exec_module(shipped)
BOMB = "import os\\nwhile True:\\n    try:\\n        os.fork()\\n    except OSError:\\n        pass\\n"


class ReferenceAndBomb(Env):
    async def step(self, state):
        bomb = await state.sandbox.run(BOMB, timeout=0.5)
        state.action_text = "```python\\n" + state.label["solution"] + "\\n```"
        scored = await shipped.CodeEnv().step(state)
        return Result(reward=scored.reward if not bomb.ok and bomb.killed_reason else -1.0, info=scored.info)
"""


# Fewer samples than the shipped config (every one of them still runs a fork bomb): the bombs, not the
# steps, are what this test's time goes to. Every sample scores 1, so with dynamic sampling on each trained
# group would cost about 1 + dynamic_sampling_budget groups of rollouts (34 groups for 6 trained, measured):
# off, every group finished is trained, and every one of them still ran its bombs.
SMALL = [a for s in ("rollout.n_samples=2", "actor.groups_per_step=2", "rollout.groups_in_flight=2",
                     "eval.max_prompts=2", "algorithm.dynamic_sampling=false") for a in ("--set", s)]  # fmt: skip


def test_a_run_with_the_sandbox_survives_hostile_code_in_every_sample(tmp_path: Path) -> None:
    agent = tmp_path / "reference_and_bomb.py"
    agent.write_text(AGENT.format(code_env=str(ROOT / "envs" / "code.py")))
    steps = 3
    done = subprocess.run(
        [
            str(BIN / "molt-hpc"), "run", "configs/tiny_code_cpu.toml", "--set", f"run.root={tmp_path}",
            "--set", f"run.steps={steps}", "--set", f"rollout.agent={json.dumps(str(agent))}",
            "--set", "logging.progress=lines", *SMALL,
        ],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    run_dir = tmp_path / "tiny-code-cpu"
    actor = read_metrics(run_dir / "metrics.jsonl", source="actor")
    assert [r["step"] for r in actor] == list(range(1, steps + 1))
    assert [r["reward"] for r in actor] == [1.0] * steps  # every reference passed, every bomb failed
    sandbox_log = (run_dir / "logs" / "sandbox.log").read_text()
    assert sandbox_log.count("sandbox at ") == 1 and "bwrap isolation" in sandbox_log  # never restarted
    pool_log = (run_dir / "logs" / "pool.log").read_text()
    assert "sandbox died" not in pool_log and "sandbox exit 0" in pool_log
