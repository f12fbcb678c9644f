"""Chat mode through the real `openai` client vs env mode: rollout tokens/s on the tiny config, same run.

One engine and the router run as their own processes on loopback (the tiny model, the tiny
config's rollout settings); this process drives groups through the same runners the orchestrator
uses, `groups_in_flight` at a time. Four agents over the same prompts, rounds alternating:
- env mode: `envs/reverse.py` (the framework owns the loop);
- chat, `ctx.openai`: `envs/reverse_chat.py`, the shared connection pool;
- chat, own client + `http_client=ctx.http_client`: a client per episode on the shared pool;
- chat, own client (the seed's style): `AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key)`
  per episode, each building its own HTTP client and TLS context on the event loop.

    .venv/bin/python bench/chat.py [--groups 48] [--rounds 3]
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

from molt_hpc.agents.chat_runner import ChatAgentRunner
from molt_hpc.agents.loader import load_agent
from molt_hpc.agents.step_runner import StepEnvRunner
from molt_hpc.config import load_config, to_toml
from molt_hpc.data import Position, PromptDataset
from molt_hpc.models import build_tiny, load_tokenizer
from molt_hpc.rollout.chat_server import ChatServer
from molt_hpc.rollout.engines import EngineLink
from molt_hpc.rollout.group import run_group
from molt_hpc.rundir import create_run_dir

REPO = Path(__file__).resolve().parents[1]
OWN_CLIENT = """
from openai import AsyncOpenAI
from molt_hpc.agents import ChatAgent, Result
from molt_hpc.agents.grading import reverse_reward
class OwnClient(ChatAgent):
    async def run(self, ctx):
        async with AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key{extra}) as client:
            messages = [{{"role": "user", "content": ctx.prompt}}]
            reply = await client.chat.completions.create(model=ctx.model, messages=messages)
        return Result(reward=reverse_reward(reply.choices[0].message.content or "", str(ctx.label)))
"""


async def drive(runner, prompts, cfg) -> float:
    """Generated tokens/s over all `prompts`, `cfg.groups_in_flight` groups at a time."""
    todo = iter(enumerate(prompts))
    tokens = 0

    async def worker():
        nonlocal tokens
        for i, prompt in todo:
            outcome = await run_group(runner, prompt, Position(0, i), cfg)
            assert outcome.failure is None, outcome.failure
            tokens += sum(s.num_action_tokens for s in outcome.group.samples)

    t0 = time.perf_counter()
    await asyncio.gather(*[worker() for _ in range(cfg.groups_in_flight)])
    return tokens / (time.perf_counter() - t0)


async def one_round(agents, tok, cfg, run, router_url, prompts) -> dict[str, float]:
    out = {}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        link = EngineLink(http, router_url, run.token(), run, cfg.rollout.request_timeout_s)
        for name, agent_file in agents.items():
            agent_cls = load_agent(str(agent_file))
            if name == "env mode":
                runner = StepEnvRunner(agent_cls, tok, cfg.rollout, link.generate)
                out[name] = await drive(runner, prompts, cfg.rollout)
                continue
            server = ChatServer(tok, link, cfg.rollout, link.token)
            await server.start()
            runner = ChatAgentRunner(agent_cls, server, cfg.rollout, http)
            try:
                out[name] = await drive(runner, prompts, cfg.rollout)
            finally:
                await runner.close()
                await server.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-chat-") as tmp:
        model_dir = build_tiny(Path(tmp) / "tiny", load_config(REPO / "configs" / "tiny_cpu.toml").model.tiny)
        overrides = [f"model.path={json.dumps(str(model_dir))}", "engines.threads=1"]
        overrides.append(f"data.path={json.dumps(str(REPO / 'data' / 'reverse_train.jsonl'))}")
        cfg = load_config(REPO / "configs" / "tiny_cpu.toml", overrides)
        run = create_run_dir(tmp, "run", to_toml(cfg))
        for name, extra in (("own", ""), ("own_pool", ", http_client=ctx.http_client")):
            (Path(tmp) / f"{name}.py").write_text(OWN_CLIENT.format(extra=extra))
        agents = {
            "env mode": REPO / "envs" / "reverse.py",
            "chat, ctx.openai": REPO / "envs" / "reverse_chat.py",
            "chat, own client + ctx.http_client": Path(tmp) / "own_pool.py",
            "chat, own client per episode": Path(tmp) / "own.py",
        }
        tok = load_tokenizer(model_dir)
        prompts = PromptDataset.load(cfg.data, tok, limit=args.groups).prompts
        procs = []
        try:
            engine, _ = start(run, "engine", "engine-0")
            procs.append(engine)
            router, router_url = start(run, "router", "router")
            procs.append(router)
            wait_for_engine(router_url, run.token())
            asyncio.run(one_round(agents, tok, cfg, run, router_url, prompts[:8]))  # warm-up
            rounds = [asyncio.run(one_round(agents, tok, cfg, run, router_url, prompts)) for _ in range(args.rounds)]
        finally:
            for p in procs:
                p.terminate()
                p.wait()
    r = cfg.rollout
    print(
        f"{args.groups} groups × {r.n_samples} samples × ≤ {r.max_new_tokens} new tokens, {r.groups_in_flight} groups"
    )
    print(f"in flight, 1 engine + router on loopback, 2 shared cores; median of {args.rounds} alternating rounds")
    print("| agent                              | rollout tok/s | vs env mode |")
    print("|------------------------------------|---------------|-------------|")
    base = statistics.median(x["env mode"] for x in rounds)
    for name in agents:
        v = statistics.median(x[name] for x in rounds)
        print(f"| {name:<34} | {v:13.0f} | {v / base:10.2f}x |")


if __name__ == "__main__":
    main()
