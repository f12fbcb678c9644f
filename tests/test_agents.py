"""The agent API around the user's code: loading an agent, calling it safely, observation glue."""

import asyncio
import math
import textwrap
import threading
from pathlib import Path

import pytest

from molt_hpc.agents import ChatAgent, Env, Result, State
from molt_hpc.agents.calls import EnvError, call_user
from molt_hpc.agents.loader import load_agent
from molt_hpc.agents.observation import ObservationFormatter
from molt_hpc.models import build_tiny_tokenizer

ROOT = Path(__file__).resolve().parents[1]


def agent_file(tmp_path: Path, body: str, name: str = "agent.py") -> str:
    path = tmp_path / name
    path.write_text("from molt_hpc.agents import ChatAgent, Env, Result\n" + textwrap.dedent(body))
    return str(path)


@pytest.mark.parametrize("name", ["math", "reverse", "calculator"])
def test_builtin_envs_load(name: str) -> None:
    cls = load_agent(str(ROOT / "envs" / f"{name}.py"))
    assert issubclass(cls, Env)


def test_an_env_and_a_chat_agent_load_from_files_and_modules(tmp_path: Path) -> None:
    env = agent_file(tmp_path, "class E(Env):\n    def step(self, state):\n        return Result(1.0)\n")
    assert load_agent(env).__name__ == "E"
    chat = agent_file(tmp_path, "class C(ChatAgent):\n    async def run(self, ctx):\n        return 1.0\n", "c.py")
    assert issubclass(load_agent(chat), ChatAgent)
    # A file named like a stdlib module does not shadow it, nor is shadowed by it.
    assert load_agent(str(ROOT / "envs" / "math.py")).__name__ == "MathEnv" and math.sqrt(4) == 2


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("X = 1\n", "declares no agent"),
        ("class Lookalike:\n    def step(self, state):\n        pass\n", r"Lookalike: has step/run but derives from"),
        ("class A(Env):\n    def step(self, s):\n        pass\nclass B(A):\n    pass\n", r"several agents \(A, B\)"),
        ("class A(Env):\n    pass\n", "does not define step"),
        ("class A(Env):\n    def step(self):\n        pass\n", "exactly one argument"),
        ("class A(Env):\n    def step(self, a, b):\n        pass\n", "exactly one argument"),
        (
            "class A(Env):\n    def __init__(self, x):\n        pass\n    def step(self, s):\n        pass\n",
            "without arguments",
        ),
        ("class A(ChatAgent):\n    def run(self, ctx):\n        pass\n", "must be a coroutine"),
    ],
)
def test_wrong_agents_are_clear_errors(tmp_path: Path, body: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_agent(agent_file(tmp_path, body))


def test_missing_agents_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not found"):
        load_agent(str(tmp_path / "nope.py"))
    with pytest.raises(ValueError, match="cannot import"):
        load_agent("no_such_module_anywhere")


def test_imported_classes_do_not_count(tmp_path: Path) -> None:
    body = "from envs_helper import Base\nclass Mine(Base):\n    def step(self, s):\n        return Result(0.0)\n"
    (tmp_path / "envs_helper.py").write_text("from molt_hpc.agents import Env\nclass Base(Env):\n    pass\n")
    import sys

    sys.path.insert(0, str(tmp_path))
    try:
        assert load_agent(agent_file(tmp_path, body)).__name__ == "Mine"
    finally:
        sys.path.remove(str(tmp_path))


def test_call_user_turns_failures_into_env_errors() -> None:
    def boom(_):
        raise KeyError("nope")

    release = threading.Event()

    def slow(_):
        release.wait(60)

    async def aslow(_):
        await asyncio.sleep(60)

    async def main() -> list[str]:
        out = [await call_user(lambda x: x + 1, 1, timeout=1, what="ok")]
        for fn in (boom, slow, aslow):
            try:
                await call_user(fn, 0, timeout=0.2, what=fn.__name__)
            except EnvError as err:
                out.append(f"{err.reason}|{err}")
        return out

    try:
        ok, raised, timed, atimed = asyncio.run(main())
        # A hung step does not hold the loop (or the test) up: the call failed while `slow` still waits.
        assert not release.is_set() and any(t.name == "user-slow" and t.is_alive() for t in threading.enumerate())
    finally:
        release.set()
    assert ok == 2
    assert raised.startswith("raised|") and "KeyError" in raised
    assert timed == "timeout|timeout: slow took longer than 0.2 s"
    assert atimed.startswith("timeout|")


def test_result_takes_numbers_tensors_and_numpy_scalars() -> None:
    import numpy as np
    import torch

    for value, want in ((1, 1.0), (0.25, 0.25), (torch.tensor(1.5), 1.5), (torch.tensor(2, dtype=torch.int64), 2.0),
                        (np.float32(0.5), 0.5), (np.int64(3), 3.0), (np.array(0.75), 0.75)):  # fmt: skip
        got = Result(reward=value).reward
        assert type(got) is float and got == want, (value, got)
    assert Result(reward=torch.tensor(1.0), score=np.float64(0.5)).score == 0.5
    for bad in ("1", None, True, [1.0], torch.tensor([1.0]), np.array([0.5]), float("nan"), torch.tensor(float("inf"))):
        with pytest.raises(EnvError, match=r"Result\.reward") as err:
            Result(reward=bad)
        assert err.value.reason == "api"


def test_state_reads_as_a_mapping() -> None:
    state = State(prompt="p", label="cba", action_text="abc", sampling_params={"temperature": 1.0},
                  observation_text="Reverse: abc")  # fmt: skip
    assert state["action_text"] == state.action_text == "abc"
    assert state.get("label") == "cba" and state.get("nope") is None and state.get("nope", 3) == 3
    assert state["observation_text"] == "Reverse: abc" and state["sampling_params"] == {"temperature": 1.0}
    assert "turn" in state and "nope" not in state and {"history", "label"} <= set(state.keys())
    with pytest.raises(KeyError, match="State has no 'nope'"):
        state["nope"]


def test_observation_glue_follows_the_template() -> None:
    tok = build_tiny_tokenizer()
    fmt = ObservationFormatter(tok)
    eos = tok.eos_token_id
    # After an action that ended with <|im_end|>, only the rest of the template's closing is added.
    assert fmt.text("obs", eos) == "\n<|im_start|>user\nobs<|im_end|>\n<|im_start|>assistant\n"
    # An action cut by the length cap gets the whole closing.
    cut = tok.convert_tokens_to_ids("x")
    assert fmt.text("obs", cut) == "<|im_end|>\n<|im_start|>user\nobs<|im_end|>\n<|im_start|>assistant\n"
    assert fmt.text({"role": "tool", "content": "21"}, eos).startswith("\n<|im_start|>tool\n21")
    # The glued conversation equals the template's own rendering of the same turns.
    conv = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}, {"role": "user", "content": "obs"}]
    head = tok.apply_chat_template(conv[:1], add_generation_prompt=True, tokenize=False)
    assert head + "a<|im_end|>" + fmt.text("obs", eos) == tok.apply_chat_template(
        conv, add_generation_prompt=True, tokenize=False
    )
    raw = ObservationFormatter(tok, apply_chat_template=False)
    assert raw.token_ids("obs", eos) == tok("obs", add_special_tokens=False)["input_ids"]
