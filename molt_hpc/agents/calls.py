"""Calling the user's code safely, and the ways a sample can fail.

`EnvError`: the user's environment raised, hung past `rollout.env_timeout_s`, or broke the API;
the orchestrator drops or retries the sample per `rollout.on_env_error`. `EngineError`: the
engines could not produce the turn even by continuing it on other engines (`molt_hpc.rollout.resume`);
the sample is retried from its start. `EpisodeLost`: the env worker holding the episode was lost (killed for
another episode's timeout, or crashed) and the episode could not be rebuilt exactly elsewhere;
the sample is retried from its start. Synchronous user code runs in its own daemon thread so a
hung call fails its sample without blocking the event loop or keeping the process alive at exit.
"""

import asyncio
import contextlib
import inspect
import threading
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any


class EnvError(RuntimeError):
    """The environment failed one sample; `reason` is a short label for metrics."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


class EngineError(RuntimeError):
    """The engine pool failed one turn in a way that a retry from the start can fix; `discarded` counts the
    tokens the sample had generated that such a retry throws away."""

    def __init__(self, message: str = "", discarded: int = 0):
        super().__init__(message)
        self.discarded = discarded


class EpisodeLost(RuntimeError):
    """The env worker holding this episode was lost and the episode could not be rebuilt exactly; a retry
    of the sample from its start fixes it."""


def _settle(fut: asyncio.Future, value: Any, error: BaseException | None) -> None:
    if fut.done():  # the caller timed out and moved on
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(value)


async def call_user(
    fn: Callable[..., Any], *args: Any, timeout: float | None, what: str, executor: Executor | None = None
) -> Any:
    """`fn(*args)` (sync in a daemon thread, or in `executor`'s threads; or a coroutine), as an `EnvError`
    if it raises or times out (None: no timeout here; an env worker's caller keeps the clock)."""
    try:
        if inspect.iscoroutinefunction(fn):
            return await asyncio.wait_for(fn(*args), timeout)
        loop = asyncio.get_running_loop()
        if executor is not None:  # reused threads: an env worker, which is killed rather than left hanging
            return await asyncio.wait_for(loop.run_in_executor(executor, fn, *args), timeout)
        fut: asyncio.Future = loop.create_future()

        def work() -> None:
            try:
                value, error = fn(*args), None
            except BaseException as err:  # handed to the event loop, which raises it as an EnvError
                value, error = None, err
            with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits for this call any more
                loop.call_soon_threadsafe(_settle, fut, value, error)

        threading.Thread(target=work, name=f"user-{what}", daemon=True).start()
        return await asyncio.wait_for(fut, timeout)
    except TimeoutError as err:
        if timeout is None:  # the user's own TimeoutError, not our clock's
            raise EnvError("raised", f"{what} raised TimeoutError: {err}") from err
        raise EnvError("timeout", f"{what} took longer than {timeout:g} s") from None
    except (EnvError, EngineError, EpisodeLost, asyncio.CancelledError):
        raise
    except Exception as err:  # the user's bug fails only this sample; the message keeps the cause
        raise EnvError("raised", f"{what} raised {type(err).__name__}: {err}") from err
