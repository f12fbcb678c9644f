"""Finding the user's agent: the one `Env` or `ChatAgent` subclass a file or module declares.

`rollout.agent` is a file path (`envs/math.py`, anything ending in `.py` or containing a `/`) or an
importable module name (`my_pkg.my_env`). Only classes defined in that file count (imported ones
such as the base classes are ignored). No agent, several agents, or one of the wrong shape (not
derived from a base class, a `step`/`run` missing or with the wrong signature, a sync `run`) is a
`ValueError` that says what to change.
"""

import hashlib
import importlib
import importlib.util
import inspect
import sys
from pathlib import Path
from types import ModuleType

from molt_hpc.agents.base import ChatAgent, Env

AgentClass = type[Env] | type[ChatAgent]


def _import(spec: str) -> ModuleType:
    if spec.endswith(".py") or "/" in spec:
        path = Path(spec).expanduser().absolute()
        if not path.is_file():
            raise ValueError(f"rollout.agent = {spec!r}: file {path} not found")
        # A private module name: envs/math.py must not shadow (or be shadowed by) the stdlib `math`.
        name = f"molt_agent_{path.stem}_{hashlib.sha256(str(path).encode()).hexdigest()[:8]}"
        module_spec = importlib.util.spec_from_file_location(name, path)
        assert module_spec is not None and module_spec.loader is not None
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module  # dataclasses and pickling look classes up by module name
        try:
            module_spec.loader.exec_module(module)
        except Exception:
            del sys.modules[name]
            raise
        return module
    try:
        return importlib.import_module(spec)
    except ModuleNotFoundError as err:
        raise ValueError(
            f"rollout.agent = {spec!r}: cannot import it ({err}); give a .py path or an importable module name"
        ) from None


def _check_method(cls: type, name: str, base: type, want_async: bool) -> None:
    method = getattr(cls, name, None)
    if method is None or method is getattr(base, name):
        raise ValueError(f"{cls.__name__} derives from {base.__name__} but does not define {name}(self, ...)")
    params = [p for p in inspect.signature(method).parameters.values() if p.default is inspect.Parameter.empty]
    if len(params) != 2 or params[1].kind not in (params[1].POSITIONAL_ONLY, params[1].POSITIONAL_OR_KEYWORD):
        raise ValueError(f"{cls.__name__}.{name} must take exactly one argument besides self")
    if want_async and not inspect.iscoroutinefunction(method):
        raise ValueError(f"{cls.__name__}.{name} must be a coroutine: write `async def {name}(self, ctx)`")


def load_agent(spec: str) -> AgentClass:
    """The agent class declared by `spec` (a file path or a module name)."""
    module = _import(spec)
    local = [c for _, c in inspect.getmembers(module, inspect.isclass) if c.__module__ == module.__name__]
    agents = [c for c in local if issubclass(c, Env | ChatAgent) and c not in (Env, ChatAgent)]
    if not agents:
        lookalikes = [c.__name__ for c in local if hasattr(c, "step") or hasattr(c, "run")]
        hint = f" ({', '.join(lookalikes)}: has step/run but derives from neither Env nor ChatAgent)" * bool(lookalikes)
        raise ValueError(
            f"rollout.agent = {spec!r} declares no agent{hint}: define one class deriving from "
            "molt_hpc.agents.Env (or ChatAgent)"
        )
    if len(agents) > 1:
        names = ", ".join(sorted(c.__name__ for c in agents))
        raise ValueError(f"rollout.agent = {spec!r} declares several agents ({names}): keep one agent per file")
    cls = agents[0]
    if issubclass(cls, Env) and issubclass(cls, ChatAgent):
        raise ValueError(f"{cls.__name__} derives from both Env and ChatAgent: pick one")
    if issubclass(cls, Env):
        _check_method(cls, "step", Env, want_async=False)
        if inspect.signature(cls).parameters:
            raise ValueError(f"{cls.__name__}() must be constructible without arguments (one instance per episode)")
    else:
        _check_method(cls, "run", ChatAgent, want_async=True)
    return cls
