"""The rollout orchestrator process, `main(cfg, run_dir)`: load the agent, the prompts and the tokenizer,
wait for the router, then run the orchestrator's loop with the runner the agent's mode needs."""

import asyncio
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from molt_hpc.config import MoltConfig
from molt_hpc.fault import fail
from molt_hpc.log import get_logger, setup_logging
from molt_hpc.rundir import RunDir

if TYPE_CHECKING:
    from molt_hpc.agents.env_workers import EnvWorkerPool

ROUTER_WAIT_S = 600.0


def main(cfg: MoltConfig, run_dir: str | Path) -> int:
    """Run the orchestrator until training is done or it is told to stop; the process exit code.

    What stops it for good is recorded as the run's failure (`molt_hpc.fault`), so the launcher stops
    the run after a checkpoint with that one line instead of restarting the pool: a `ValueError` (the
    data, the agent, a cursor of another dataset: the config must change; exit 2) or a crash (exit 1,
    the traceback in this process's log)."""
    import torch

    torch.set_num_threads(1)
    setup_logging("rollout", cfg.logging.level)
    run = RunDir(Path(run_dir).absolute())
    try:
        return asyncio.run(serve(cfg, run))
    except ValueError as err:
        fail(run.path, str(err), "rollout", config_error=True)
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 2
    except Exception as err:
        fail(
            run.path, f"the rollout orchestrator crashed: {type(err).__name__}: {err} (see logs/rollout.log)", "rollout"
        )
        raise


@dataclass
class Inputs:
    """What the orchestrator works from, loaded before any engine is waited for."""

    agent_cls: type
    tokenizer: Any
    vision: Any
    dataset: Any
    eval_prompts: list


def load_inputs(cfg: MoltConfig, run: RunDir) -> Inputs:
    """The agent class, tokenizer, vision processor and prompts (training and held-out) of the run."""
    from molt_hpc.agents import ChatAgent
    from molt_hpc.agents.loader import load_agent
    from molt_hpc.data import PromptDataset
    from molt_hpc.datasets.generated import prompt_files
    from molt_hpc.models import load_tokenizer, resolve_model
    from molt_hpc.vision.processor import Vision

    agent_cls = load_agent(cfg.rollout.agent)
    model_dir = resolve_model(cfg.model, run.models)
    tokenizer = load_tokenizer(model_dir)
    vision = Vision.of(model_dir)
    images = {"vision": vision, "max_images": cfg.rollout.max_images}
    train_path, eval_path = prompt_files(cfg, run.path)
    dataset = PromptDataset.load(cfg.data, tokenizer, path=train_path, **images)
    ev = cfg.eval
    eval_prompts = (
        PromptDataset.load(cfg.data, tokenizer, path=eval_path, limit=ev.max_prompts, **images).prompts if ev else []
    )
    if issubclass(agent_cls, ChatAgent) and any(p.images for p in [*dataset.prompts, *eval_prompts]):
        raise ValueError(
            f"rollout.agent = {cfg.rollout.agent!r} is a chat-mode agent, which does not take images yet; the rows of "
            f"{cfg.data.path} have images: write the agent as an Env (env mode sends images to the engines)"
        )
    get_logger().info(
        "agent %s, %d prompts from %s, %d eval prompts",
        agent_cls.__name__,
        len(dataset),
        cfg.data.path,
        len(eval_prompts),
    )
    return Inputs(agent_cls, tokenizer, vision, dataset, eval_prompts)


async def serve(cfg: MoltConfig, run: RunDir) -> int:
    """The orchestrator's life in this process: inputs, env workers, the router, the loop; the exit code."""
    import aiohttp

    from molt_hpc.buffer import open_buffer
    from molt_hpc.rollout.engines import EngineLink, wait_for_router
    from molt_hpc.rollout.orchestrator import Orchestrator

    inputs = load_inputs(cfg, run)
    buffer = open_buffer(cfg.buffer, run.path, producer_id="rollout")
    stop = asyncio.Event()
    Orchestrator.install_stop_handlers(stop)
    envs = env_pool(cfg, inputs.agent_cls)  # its workers start while the engines load
    try:
        try:
            router_url = await wait_for_router(run, ROUTER_WAIT_S, stop)
        except asyncio.CancelledError:
            return 0
        token = run.token()
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
            link = EngineLink(http, router_url, token, run, cfg.rollout.request_timeout_s)
            await run_loop(cfg, run, inputs, link, buffer, stop, envs)
    finally:
        if envs is not None:
            await envs.close()
    return 0


async def run_loop(cfg: MoltConfig, run: RunDir, inputs: Inputs, link, buffer, stop, envs) -> None:
    """The orchestrator's loop with the agent's runner: chat mode behind our chat endpoint, or env mode."""
    from molt_hpc.agents import ChatAgent
    from molt_hpc.agents.chat_runner import ChatAgentRunner
    from molt_hpc.agents.step_runner import StepEnvRunner
    from molt_hpc.rollout.chat_server import ChatServer
    from molt_hpc.rollout.orchestrator import Orchestrator
    from molt_hpc.rollout.teacher import group_teacher
    from molt_hpc.rundir import atomic_write

    agent_cls, tokenizer, token = inputs.agent_cls, inputs.tokenizer, link.token
    server = None
    if issubclass(agent_cls, ChatAgent):
        server = ChatServer(tokenizer, link, cfg.rollout, token, routed_experts=cfg.actor.router_replay)
        atomic_write(run.rendezvous / "chat.json", json.dumps({"url": await server.start()}))
        runner = ChatAgentRunner(agent_cls, server, cfg.rollout, link.session)
    else:
        runner = StepEnvRunner(
            agent_cls,
            tokenizer,
            cfg.rollout,
            link.generate,
            apply_chat_template=cfg.data.apply_chat_template,
            system_prompt=cfg.data.system_prompt,
            seed=cfg.run.seed,
            envs=envs,
            routed_experts=cfg.actor.router_replay,
            vision=inputs.vision,
        )
    scorer = reward_scorer(cfg, run, link.session, token, tokenizer)
    teacher = group_teacher(cfg, run, link.session, token, tokenizer, agent_cls)
    try:
        orchestrator = Orchestrator(
            cfg, run, inputs.dataset, runner, link, buffer, inputs.eval_prompts, stop, scorer, teacher
        )
        await orchestrator.run_loop()
    finally:
        if server is not None:
            await runner.close()
            await server.close()


def env_pool(cfg: MoltConfig, agent_cls: type) -> "EnvWorkerPool | None":
    """The started env worker pool of an env-mode agent (`rollout.env_workers`); None for in-process envs."""
    from molt_hpc.agents import ChatAgent
    from molt_hpc.agents.env_workers import EnvWorkerPool, worker_count

    workers = worker_count(cfg.rollout.env_workers)
    if issubclass(agent_cls, ChatAgent) or workers == 0:
        return None
    pool = EnvWorkerPool(cfg.rollout.agent, workers, cfg.rollout.env_timeout_s)
    pool.start()
    get_logger().info("%d env worker(s) run %s", workers, agent_cls.__name__)
    return pool


def reward_scorer(cfg: MoltConfig, run: RunDir, http, token: str, tokenizer):
    """The group scorer of `[reward_model]`, or None without one (checked before any rollout starts)."""
    if cfg.reward_model is None:
        return None
    from molt_hpc.models.reward import check_reward_model
    from molt_hpc.rollout.scoring import GroupScorer
    from molt_hpc.scorer.client import ScorerClient

    stats = check_reward_model(cfg.reward_model, tokenizer)
    get_logger().info("reward model %s: combine %s, scores normalised by %s", cfg.reward_model.path,
                      cfg.reward_model.combine, stats)  # fmt: skip
    return GroupScorer(ScorerClient(http, run, token, cfg.reward_model), cfg.reward_model, stats)
