"""Env calls in worker processes vs the orchestrator's threads: rollout groups/s on the tiny config, same run.

One engine and the router run as their own processes on loopback (the tiny model and the tiny
config's rollout settings: 8 samples a group, 16 groups in flight); this process drives groups
through `StepEnvRunner` as the orchestrator does. Rows, each round in a rotated order:
- in-process: `rollout.env_workers = 0`, `envs/reverse.py` in the orchestrator's threads;
- workers: `envs/reverse.py` in `rollout.env_workers = auto` worker processes, started once before
  the first round (the orchestrator starts them while the engines load; their start-up is printed);
- workers, 1 step in N hangs: the same env, except that one step in N at random (`--hang-every`)
  runs `(a+)+$` on a long run of `a`s (the GIL held for hours) and is killed after
  `env_timeout_s = 2`; its group is dropped (`on_env_error = drop_group`), the others go on. The
  in-process host would freeze on the first one, so it has no such row.

    .venv/bin/python bench/env_workers.py [--groups 256] [--rounds 5] [--hang-every 256]
"""

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp
from router import start, wait_for_engine  # bench/router.py

from molt_hpc.agents.env_workers import EnvWorkerPool, worker_count
from molt_hpc.agents.loader import load_agent
from molt_hpc.agents.step_runner import StepEnvRunner
from molt_hpc.config import load_config, to_toml
from molt_hpc.data import Position, PromptDataset
from molt_hpc.models import build_tiny, load_tokenizer
from molt_hpc.rollout.engines import EngineLink
from molt_hpc.rollout.group import run_group
from molt_hpc.rundir import create_run_dir

REPO = Path(__file__).resolve().parents[1]
HANGING = """
import random
import re

from molt_hpc.agents import Env, Result
from molt_hpc.agents.grading import reverse_reward

class SometimesHangs(Env):
    def step(self, state):
        if random.random() < 1 / {every}:
            re.match(r"(a+)+$", "a" * 40 + "b")  # catastrophic backtracking: 2^40 steps, GIL held
        return Result(reward=reverse_reward(state.action_text, str(state.label)))
"""


async def drive(runner, prompts, cfg) -> tuple[float, int]:
    """(finished groups per second, failed groups) over all `prompts`, `cfg.groups_in_flight` at a time."""
    todo = iter(enumerate(prompts))
    done = failed = 0

    async def worker():
        nonlocal done, failed
        for i, prompt in todo:
            outcome = await run_group(runner, prompt, Position(0, i), cfg)
            assert outcome.failure in (None, "env_timeout"), outcome.failure
            done += outcome.failure is None
            failed += outcome.failure is not None

    t0 = time.perf_counter()
    await asyncio.gather(*[worker() for _ in range(cfg.groups_in_flight)])
    return done / (time.perf_counter() - t0), failed


async def bench(args, tok, cfg, router_url, run, prompts, hang_file: Path) -> tuple[list[dict], float]:
    rollout = cfg.rollout
    hang_cfg = rollout.model_copy(update={"env_timeout_s": 2.0})
    reverse = str(REPO / "envs" / "reverse.py")
    workers = worker_count(rollout.env_workers)
    t0 = time.perf_counter()
    pool = EnvWorkerPool(reverse, workers, rollout.env_timeout_s)
    hang_pool = EnvWorkerPool(str(hang_file), workers, hang_cfg.env_timeout_s)
    await asyncio.gather(pool.ready(), hang_pool.ready())
    startup = time.perf_counter() - t0
    rounds = []
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
            link = EngineLink(http, router_url, run.token(), run, rollout.request_timeout_s)
            runners = {
                "in-process (env_workers = 0)": (
                    StepEnvRunner(load_agent(reverse), tok, rollout, link.generate),
                    rollout,
                ),
                f"workers (env_workers = {workers})": (
                    StepEnvRunner(load_agent(reverse), tok, rollout, link.generate, envs=pool),
                    rollout,
                ),
                f"workers, 1 step in {args.hang_every} hangs": (
                    StepEnvRunner(load_agent(str(hang_file)), tok, hang_cfg, link.generate, envs=hang_pool),
                    hang_cfg,
                ),
            }
            for runner, c in runners.values():  # warm-up
                await drive(runner, prompts[:4], c)
            names = list(runners)
            for i in range(args.rounds):  # each round in another order: no row always runs first or last
                result = {}
                for name in names[i % len(names) :] + names[: i % len(names)]:
                    runner, c = runners[name]
                    result[name] = await drive(runner, prompts, c)
                rounds.append(result)
    finally:
        await pool.close()
        await hang_pool.close()
        rounds.append({"plain": dict(pool.counts), "hanging": dict(hang_pool.counts)})
    return rounds, startup


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--hang-every", type=int, default=256)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-env-workers-") as tmp:
        model_dir = build_tiny(Path(tmp) / "tiny", load_config(REPO / "configs" / "tiny_cpu.toml").model.tiny)
        overrides = [f"model.path={json.dumps(str(model_dir))}", "engines.threads=1"]
        overrides.append(f"data.path={json.dumps(str(REPO / 'data' / 'reverse_train.jsonl'))}")
        cfg = load_config(REPO / "configs" / "tiny_cpu.toml", overrides)
        run = create_run_dir(tmp, "run", to_toml(cfg))
        hang_file = Path(tmp) / "sometimes_hangs.py"
        hang_file.write_text(HANGING.format(every=args.hang_every))
        tok = load_tokenizer(model_dir)
        prompts = PromptDataset.load(cfg.data, tok, limit=args.groups).prompts
        procs = []
        try:
            engine, _ = start(run, "engine", "engine-0")
            procs.append(engine)
            router, router_url = start(run, "router", "router")
            procs.append(router)
            wait_for_engine(router_url, run.token())
            rounds, startup = asyncio.run(bench(args, tok, cfg, router_url, run, prompts, hang_file))
        finally:
            for p in procs:
                p.terminate()
                p.wait()
    counts = rounds.pop()
    r = cfg.rollout
    print(
        f"{args.groups} groups × {r.n_samples} samples × ≤ {r.max_new_tokens} new tokens, {r.groups_in_flight} groups"
    )
    print(f"in flight, 1 engine + router on loopback; median of {args.rounds} rounds, each in a rotated order")
    print(f"worker start-up (both pools, once): {startup:.2f} s; pool counters: {counts}")
    print("| env host                           | groups/s | vs in-process | groups failed per round |")
    print("|------------------------------------|----------|---------------|-------------------------|")
    names = sorted(rounds[0], key=lambda n: (not n.startswith("in-process"), len(n)))
    base = statistics.median(x[names[0]][0] for x in rounds)
    for name in names:
        v = statistics.median(x[name][0] for x in rounds)
        failed = statistics.median(x[name][1] for x in rounds)
        print(f"| {name:<34} | {v:8.2f} | {v / base:12.2f}x | {failed:23g} |")


if __name__ == "__main__":
    main()
