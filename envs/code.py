"""Write a function: the reply's code runs against the row's hidden tests in the sandbox (`[sandbox]`).

The reply's last ```python block (or any ``` block; else the whole reply when it defines something) is
the solution. A harness runs in the sandbox: it executes the solution, then each hidden test (the label's
`tests`, `assert` lines) in the solution's namespace, and prints how many passed after a nonce it reads
from stdin only once every test has run (so the solution's own prints cannot pose as the count). The
reward is the fraction of tests passed; anything the code does wrong (a crash, a limit, no answer line)
scores 0 and fails nothing else. Labels: `{"entry": "add", "tests": ["assert add(1, 2) == 3", ...]}`.

What the harness cannot stop: a solution that reads stdin itself during a test call can learn the nonce
and print a forged count. The sandbox contains such code; it does not make its reward honest.
"""

import json
import re
import secrets

from molt_hpc.agents import Env, Result, State

FENCE_RE = re.compile(r"```(python|py)?[ \t]*\n(.*?)```", re.DOTALL)

HARNESS = """\
import json, os
read, write, leave = os.read, os.write, os._exit  # kept before the solution can replace them
tests = json.load(open("tests.json"))
scope = {"__name__": "solution"}
try:
    exec(compile(open("solution.py").read(), "solution.py", "exec"), scope)
    loaded = True
except BaseException:
    loaded = False
passed = 0
for test in tests if loaded else []:
    try:
        exec(compile(test, "test", "exec"), scope)
        passed += 1
    except BaseException:
        pass
nonce = read(0, 256).decode()
write(1, ("\\n%s %d\\n" % (nonce, passed)).encode())
leave(0)
"""


def extract_code(text: str) -> str | None:
    """The solution in a reply: its last ```python block, else its last ``` block, else the whole reply if
    it defines a function; None when there is no code."""
    blocks = FENCE_RE.findall(text)
    if blocks:
        tagged = [body for tag, body in blocks if tag]
        return (tagged or [body for _, body in blocks])[-1]
    return text if "def " in text else None


def passed_count(stdout: str, nonce: str, total: int) -> int | None:
    """Tests passed, from the harness's last line (`<nonce> <count>`); None when that line is not there."""
    lines = stdout.rstrip("\n").rsplit("\n", 1)
    parts = lines[-1].split(" ")
    if len(parts) != 2 or parts[0] != nonce or not parts[1].isdigit() or int(parts[1]) > total:
        return None
    return int(parts[1])


class CodeEnv(Env):
    """Score the reply's function by its hidden tests, run in the sandbox; one turn."""

    async def step(self, state: State) -> Result:
        tests = list(state.label["tests"])
        code = extract_code(state.action_text)
        info = {"code_found": float(code is not None), "passed_all": 0.0, "timeout": 0.0, "no_result": 0.0}
        if code is None or not tests:
            return Result(reward=0.0, info=info)
        nonce = secrets.token_hex(16)
        files = {"solution.py": code, "tests.json": json.dumps(tests)}
        result = await state.sandbox.run(HARNESS, stdin=nonce, files=files)
        passed = passed_count(result.stdout, nonce, len(tests)) if result.exit_code == 0 else None
        info["timeout"] = float(result.timed_out)
        info["no_result"] = float(passed is None)
        info["passed_all"] = float(passed == len(tests))
        return Result(reward=(passed or 0) / len(tests), info=info)
