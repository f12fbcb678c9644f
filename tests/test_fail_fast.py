"""Bad inputs fail fast and clearly: one table of common mistakes (data, env, model, config, resume, Slurm).

Each case runs the real `molt-hpc` command in a fresh directory and asserts the contract of the
pre-flight: exit code 2, one `error:` line on stderr that names the key (or the run) and the fix, no
traceback, nothing created and nothing left running, and the time to fail — CPU seconds of the
command (what the check costs, whatever else loads this machine) under 5 s, wall time bounded.
"""

import json
import os
import resource
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from molt_hpc import checkpoint as ck
from molt_hpc.config import load_config, to_toml
from molt_hpc.rundir import create_run_dir
from tests.conftest import BIN, ROOT

CPU_LIMIT_S = 4.0
"""A bad input is reported before torch is imported (under 2 s of CPU on a quiet 2-core box)."""
MODEL_DIR_CPU_LIMIT_S = 10.0
"""A model directory is checked through transformers' Auto classes, which import torch (~4.5 s quiet)."""
WALL_LIMIT_S = 30.0  # a hang, not load


@dataclass
class Case:
    args: list[str]
    expected: list[str]
    """Substrings of the one error line."""
    env: dict[str, str] = field(default_factory=dict)
    stdout: str | None = None
    """A substring stdout must hold (default: stdout empty)."""
    cpu_limit_s: float = CPU_LIMIT_S


BAD_ENVS = {
    "syntax.py": "from molt_hpc.agents import Env\nclass E(Env)\n    pass\n",
    "raises.py": "import no_such_module_for_molt\n",
    "none.py": "class NotAnEnv:\n    def step(self, state):\n        return 1.0\n",
    "two.py": "from molt_hpc.agents import Env, Result\n"
    + "".join(f"class E{i}(Env):\n    def step(self, state):\n        return Result(0.0)\n" for i in range(2)),
}


def write_files(base: Path, model: Path) -> None:
    """The broken inputs the cases point at, in the case's working directory."""
    for name, text in BAD_ENVS.items():
        (base / "envs").mkdir(exist_ok=True)
        (base / "envs" / name).write_text(text)
    data = base / "data"
    data.mkdir()
    (data / "not_json.jsonl").write_text('{"prompt": "Reverse: ab", "label": "ba"}\nnot json\n')
    (data / "empty.jsonl").write_text("\n")
    (data / "question.jsonl").write_text('{"question": "Reverse: ab", "label": "ba"}\n')
    (data / "chat.jsonl").write_text(json.dumps({"prompt": [{"role": "user", "content": "hi"}], "label": "x"}) + "\n")
    (base / "a_file").write_text("")
    for name, drop in (("no_config", "config.json"), ("no_weights", "model.safetensors"), ("bad_template", None)):
        shutil.copytree(model, base / name)
        if drop:
            (base / name / drop).unlink()
    (base / "bad_template" / "chat_template.jinja").write_text("{% if %}")


def run_dirs(base: Path) -> None:
    """Run directories for the resume cases: finished, damaged, still running, resume = never."""
    cfg = load_config(ROOT / "configs" / "tiny_cpu.toml", ["run.steps=5", f"run.root={base / 'runs'}"])
    for name in ("finished", "damaged", "running"):
        run = create_run_dir(base / "runs", name, to_toml(cfg))
        tmp = ck.begin(run.checkpoints, 5)
        ck.write_json(tmp / ck.RUN_STATE, {"step": 5})
        ck.write_manifest(tmp)
        ck.publish(run.checkpoints, tmp, 5, keep_last=2)
    (base / "runs" / "damaged" / "checkpoints" / ck.step_name(5) / ck.MANIFEST).unlink()
    never = load_config(None, ["checkpoint.resume=never"])
    create_run_dir(base / "runs", "never", to_toml(never))


def cases(base: Path) -> dict[str, Case]:
    run = ["run", str(ROOT / "configs" / "tiny_cpu.toml"), "--set", f"run.root={base / 'runs'}"]
    submit = ["submit", str(ROOT / "configs" / "tiny_cpu.toml"), "--set", f"run.root={base / 'runs'}"]
    envs, data = str(ROOT / "envs" / "reverse.py"), str(ROOT / "data" / "reverse_train.jsonl")

    def run_with(*overrides: str) -> list[str]:
        return [*run, "--set", f"rollout.agent={envs}", "--set", f"data.path={data}", *_sets(overrides)]

    return {
        # data
        "data file missing": Case(run_with("data.path=nope.jsonl"), ["data.path = 'nope.jsonl'", "does not exist",
                                                                     f"working directory, {base}"]),
        "data row not JSON": Case(run_with("data.path=data/not_json.jsonl"), ["line 2: invalid JSON"]),
        "data empty": Case(run_with("data.path=data/empty.jsonl"), ["has no rows"]),
        "data key wrong": Case(run_with("data.path=data/question.jsonl"), ["line 1: missing 'prompt'", "on_bad_row"]),
        "data no usable row": Case(run_with("data.path=data/question.jsonl", "data.on_bad_row=skip"),
                                   ["no usable row", "data.prompt_key"]),
        "prompts too long": Case(run_with("data.max_prompt_tokens=8"),
                                 ["of the first 256 rows", "over data.max_prompt_tokens = 8", "raise data.max_prompt"]),
        "chat prompt, no template": Case(run_with("data.path=data/chat.jsonl", "data.apply_chat_template=false"),
                                         ["chat-message prompts need data.apply_chat_template = true"]),
        "eval file missing": Case(run_with("eval.path=nope.jsonl"), ["eval.path = 'nope.jsonl'"]),
        # env
        "env file missing": Case(run_with("rollout.agent=envs/nope.py"), ["rollout.agent = 'envs/nope.py'",
                                                                          "does not exist"]),
        "env syntax error": Case(run_with("rollout.agent=envs/syntax.py"), ["does not compile", "line 2"]),
        "env import fails": Case(run_with("rollout.agent=envs/raises.py"), ["ModuleNotFoundError",
                                                                           "no_such_module_for_molt"]),
        "env declares no agent": Case(run_with("rollout.agent=envs/none.py"), ["declares no agent", "NotAnEnv"]),
        "env declares two": Case(run_with("rollout.agent=envs/two.py"), ["declares several agents (E0, E1)"]),
        "env module unknown": Case(run_with("rollout.agent=no_such_pkg.env"), ["cannot import it"]),
        # model
        "model missing": Case(run_with("model.path=no/model"), ["model.path = 'no/model'", "does not exist"]),
        "model no config": Case(run_with("model.path=no_config"), ["has no config.json"]),
        "model no weights": Case(run_with("model.path=no_weights"), ["has no weights"]),
        "model unknown builtin": Case(run_with("model.path=builtin:nope"), ["the builtin models are"]),
        "chat template broken": Case(run_with("model.path=bad_template"), ["data.apply_chat_template = True",
                                                                           "does not render"],
                                     cpu_limit_s=MODEL_DIR_CPU_LIMIT_S),
        # config
        "config unknown key": Case(run_with("rollout.agnet=x"), ["unknown key 'rollout.agnet'", "rollout.agent"]),
        "config cross rule": Case(run_with("rollout.max_new_tokens=500"), ["exceeds rollout.max_total_tokens"]),
        "run root is a file": Case([*run_with(), "--set", "run.root=a_file/runs"], ["not a writable directory"]),
        # resume
        "resume not a run": Case(["run", "--resume", "data"], ["is not a run directory"]),
        "resume finished": Case(["run", "--resume", "runs/finished"], ["already trained 5 steps", "run.steps=N"]),
        "resume damaged": Case(["run", "--resume", "runs/damaged"], ["not a whole checkpoint"]),
        "resume running": Case(["run", "--resume", "runs/running", "--set", "run.steps=9"], ["is still running"]),
        "resume never": Case(["run", "--resume", "runs/never"], ["checkpoint.resume = 'never'"]),
        # Slurm
        "submit without Slurm": Case([*submit, *_sets([f"rollout.agent={envs}", f"data.path={data}"])],
                                     ["sbatch is not on PATH"], env={"PATH": str(base / "no-bin")}),
        "submit data missing": Case([*submit, *_sets([f"rollout.agent={envs}", "data.path=nope.jsonl"])],
                                    ["data.path = 'nope.jsonl'"]),
        "dry-run data missing": Case([*submit, *_sets([f"rollout.agent={envs}", "data.path=nope.jsonl"]),
                                      "--dry-run"], ["data.path = 'nope.jsonl'"], stdout="#SBATCH hetjob"),
        "sbatch env missing": Case(["sbatch", *_sets([f"data.path={data}", "rollout.agent=envs/nope.py"]),
                                    "-o", "job.sh"], ["rollout.agent"]),
        "stop timeout too long": Case(run_with("slurm.stop_timeout_s=200"),
                                      ["slurm.stop_timeout_s (200) is not shorter"]),
        "cancel without a job": Case(["cancel", "runs/never"], ["has no Slurm job on record"]),
    }  # fmt: skip


def _sets(overrides) -> list[str]:
    return [arg for item in overrides for arg in ("--set", item)]


def processes_mentioning(text: str) -> list[int]:
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if text.encode() in cmdline.read_bytes():
                found.append(int(cmdline.parent.name))
        except OSError:  # ended meanwhile
            continue
    return [p for p in found if p != os.getpid()]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, tiny_model_dir):
    base = tmp_path_factory.mktemp("fail-fast")
    write_files(base, tiny_model_dir)
    run_dirs(base)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", str(base / "runs" / "running")])
    (base / "runs" / "running" / "processes.json").write_text(json.dumps({"actor pool": sleeper.pid}))
    try:
        yield base, cases(base)
    finally:
        sleeper.kill()
        sleeper.wait()


CASE_NAMES = sorted(cases(Path("/base")))


def test_the_table_covers_every_kind_of_input() -> None:
    assert len(CASE_NAMES) >= 20


@pytest.mark.parametrize("name", CASE_NAMES)
def test_bad_input_fails_fast_with_one_line(workdir, name: str) -> None:
    base, table = workdir
    case = table[name]
    before = sorted(p.name for p in (base / "runs").iterdir())
    env = {**os.environ, **case.env}
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    out = subprocess.run([str(BIN / "molt-hpc"), *case.args], cwd=base, env=env, capture_output=True, text=True,
                         timeout=WALL_LIMIT_S)  # fmt: skip
    wall = time.monotonic() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - used.ru_utime) + (after.ru_stime - used.ru_stime)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr
    assert "Traceback" not in out.stderr
    for part in case.expected:
        assert part in lines[0], lines[0]
    assert (case.stdout in out.stdout) if case.stdout else out.stdout == ""
    assert sorted(p.name for p in (base / "runs").iterdir()) == before, "a run directory was made"
    assert not (base / "job.sh").exists()
    assert processes_mentioning(str(base / "runs" / "tiny-cpu")) == [], "a process was left running"
    assert cpu < case.cpu_limit_s and wall < WALL_LIMIT_S, f"failed after {cpu:.2f} s CPU, {wall:.2f} s wall"
