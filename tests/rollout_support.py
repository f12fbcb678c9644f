"""Helpers of the rollout tests (`test_rollout.py`, `test_chat_openai.py`): a link to the shared pool's
router, the teacher-forced log-prob check, env files, and a long group held in flight while a fault is
injected."""

import asyncio
import contextlib
import copy
import itertools
import json
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import torch

from molt_hpc.agents.loader import load_agent
from molt_hpc.agents.step_runner import StepEnvRunner
from molt_hpc.data import Position
from molt_hpc.engine import client
from molt_hpc.engine.stream import Partial
from molt_hpc.rollout.engines import EngineLink
from molt_hpc.rollout.group import run_group
from tests.conftest import ROOT

NO_STOP = {"ignore_eos": True, "stop_token_ids": []}  # fixed-length samples: every turn uses its whole cap


def with_link(pool, fn):
    """Run `fn(link)` in a fresh event loop with a link to the pool's router."""

    async def main():
        router = json.loads((pool.run.rendezvous / "router.json").read_text())["url"]
        async with aiohttp.ClientSession() as http:
            link = EngineLink(http, router, pool.run.token(), pool.run, timeout_s=60)
            return await fn(link)

    return asyncio.run(main())


async def freeze_mid_answer(link, url: str, session: str, start, n: int = 12) -> tuple[asyncio.Task, list[int]]:
    """(the request's task, its first `n` tokens): the request `start()` starts (a coroutine) is held by the
    engine at `url` after exactly `n` tokens. The engine is frozen before the request reaches it and runs
    `n - 1` steps for it (its first prefills one token and decodes one: `resume(steps=...)`), so it holds the
    request mid-answer whatever the timing of the calls; a pause sent when the client saw the 12th token once
    raced the decode on a loaded machine and lost (the answer ended first). Fails, saying so, when the request
    is not held at `url` (the router sent it elsewhere)."""
    await client.pause(link.session, url, token=link.token, mode="keep")
    task = asyncio.create_task(start())
    await wait_until(lambda: _holds(link, url), what=f"the engine at {url} to hold the request (routed elsewhere?)")
    await client.resume(link.session, url, token=link.token, steps=n - 1)
    await wait_until(lambda: _all_streamed(link, 1, n, [session]), what=f"{n} tokens streamed from {url}")
    return task, list(link.streaming[session].token_ids)


async def _holds(link, url: str) -> bool:
    return await requests_held(link, [url]) == 1


def teacher_forced(model, tokens: list[int]) -> torch.Tensor:
    """log p(token t | tokens < t) for every t >= 1, from one plain forward pass (temperature 1)."""
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].double()
    return torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]


def check_logprobs(model, traj) -> None:
    """The trace's log-probs equal a teacher-forced forward over each of its segments (1e-4)."""
    edges = [0, *traj.segments, len(traj.tokens)]
    want = []
    for lo, hi in itertools.pairwise(edges):
        forced = teacher_forced(model, traj.tokens[lo:hi])
        want += [forced[t - lo - 1] for start, end in traj.action_ranges if lo <= start < hi for t in range(start, end)]
    want = torch.stack(want) if want else torch.zeros(0, dtype=torch.float64)
    got = torch.tensor(traj.action_logprobs, dtype=torch.float64)
    assert torch.allclose(got, want, atol=1e-4), (got, want)


def env_file(tmp_path: Path, body: str) -> str:
    path = tmp_path / "env_under_test.py"
    path.write_text("import time\nfrom molt_hpc.agents import Env, Result\n" + textwrap.dedent(body))
    return str(path)


async def wait_until(condition, timeout: float = 60.0, what: str = "the condition") -> None:
    """Poll the coroutine `condition()` until it is true (a test waits for what it needs, not a time)."""
    deadline = time.monotonic() + timeout
    while not await condition():
        assert time.monotonic() < deadline, f"{what}: not reached in {timeout:.0f} s"
        await asyncio.sleep(0.05)


async def requests_held(link, urls: list[str]) -> int:
    """Requests the engines at `urls` hold (running or waiting)."""
    total = 0
    for url in urls:
        status = await client.health(link.session, url, token=link.token)
        total += status["running"] + status["waiting"]
    return total


@dataclass
class Held:
    """What `long_group` saw: the group's outcome, the tokens each session had streamed when the fault came,
    and the link's migration counts."""

    outcome: Any
    streamed: dict[str, Partial]
    counts: dict[str, int]


def long_group(pool, tok, dataset, during, streamed: int = 0) -> Held:
    """A group of long samples (200 tokens each, EOS ignored); `during(link)` runs while every one of its
    requests is held by a paused engine, so the fault it injects always finds them in flight. With
    `streamed`, the requests first run until each has streamed that many tokens, then are frozen again."""
    cfg = pool.cfg.rollout.model_copy(update={"n_samples": 4, "max_new_tokens": 200, "max_total_tokens": 256})
    env_cls = load_agent(str(ROOT / "envs" / "reverse.py"))

    async def go(link):
        urls = [pool.engine_url(i) for i in range(len(pool.engines)) if pool.engines[i].proc.poll() is None]
        await pause_all(link, urls)
        runner = StepEnvRunner(env_cls, tok, cfg, _ignore_eos(link.generate))
        task = asyncio.create_task(run_group(runner, dataset[2], Position(0, 2), cfg))
        try:
            await wait_until(lambda: _all_held(link, urls, cfg.n_samples))
            if streamed:  # each engine runs exactly the steps that make `streamed` tokens, then freezes again
                await resume_all(link, urls, steps=streamed - 1)
                await wait_until(lambda: _all_streamed(link, cfg.n_samples, streamed))
            seen = {s: copy.deepcopy(p) for s, p in link.streaming.items()}
            await during(link)
        finally:
            await resume_all(link, urls)
        return Held(await task, seen, link.take_counts())

    return with_link(pool, go)


async def pause_all(link, urls: list[str], mode: str = "keep") -> None:
    for url in urls:
        await client.pause(link.session, url, token=link.token, mode=mode)


async def resume_all(link, urls: list[str], steps: int | None = None) -> None:
    for url in urls:  # a killed engine does not answer: the others go on
        with contextlib.suppress(aiohttp.ClientError, OSError, RuntimeError):
            await client.resume(link.session, url, token=link.token, timeout=5, steps=steps)


async def _all_streamed(link, n: int, tokens: int, sessions: list[str] | None = None) -> bool:
    parts = [link.streaming.get(s) for s in sessions] if sessions else list(link.streaming.values())
    return len(parts) == n and all(p is not None and len(p.token_ids) >= tokens for p in parts)


async def _all_held(link, urls: list[str], n: int) -> bool:
    return await requests_held(link, urls) == n


def _ignore_eos(generate):
    async def wrapped(token_ids, params, session_id):
        return await generate(token_ids, {**params, **NO_STOP}, session_id)

    return wrapped
