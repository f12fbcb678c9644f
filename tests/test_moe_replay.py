"""Router replay end to end on a CPU: a real builtin engine process records routing in vLLM's format, the
trajectory and the buffer keep it aligned, and the trainer's routers replay it.

The engines serve tiny MoE models in fp32, so the trainer's live routing on the same weights must equal
the engine's exactly. Requests are submitted while the engine is paused and released together, so each
test's batches (and so its floating-point sums) are the same on every run.
"""

import asyncio
import copy
import json

import aiohttp
import numpy as np
import pytest
import torch

from molt_hpc.actor.moe_router import MoeRouting
from molt_hpc.agents.routing import RoutingTrace
from molt_hpc.algorithm import make_experience
from molt_hpc.algorithm.logprobs import token_logprobs
from molt_hpc.buffer.codec import decode_group, encode_group
from molt_hpc.config import MoltConfig
from molt_hpc.engine import client
from molt_hpc.engine.routing import decode_routing
from molt_hpc.models import build_tiny_moe, load_causal_lm, load_tokenizer
from molt_hpc.trajectory import Group, Trajectory
from tests.test_engine_procs import make_run, start_engines

PROMPTS = ["Reverse: abc", "Reverse: hello world", "Hi", "Reverse: slurm gpu fsdp", "xy"]


def _model(root, **shape):
    return build_tiny_moe(root, MoltConfig().model.tiny_moe.model_copy(update=shape))


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """A tiny MoE with a dense block in the middle (layers: MoE, dense, MoE), served with capture on."""
    root = tmp_path_factory.mktemp("moe-engine")
    model_dir = _model(root / "model", num_layers=3, dense_layers=[1])
    run = make_run(root, "moe", model_dir, "actor.router_replay=true", "engines.max_batch=16")
    [proc] = start_engines(run, [0])
    yield proc.url, run.token(), model_dir
    assert proc.stop() == 0


async def _generate_together(url: str, token: str, requests: list[tuple[list[int], dict]]) -> list:
    """Every request admitted in one prefill: sent while the engine is paused, released at once."""
    async with aiohttp.ClientSession() as session:
        await client.pause(session, url, token=token, mode="keep")
        tasks = [
            asyncio.create_task(client.generate(session, url, ids, sp, token=token, session_id=str(i)))
            for i, (ids, sp) in enumerate(requests)
        ]
        while (await client.health(session, url, token=token))["waiting"] < len(requests):
            for task in tasks:
                if task.done():  # refused (a 4xx): its error, not an endless wait
                    await client.resume(session, url, token=token)
                    task.result()
            await asyncio.sleep(0.05)
        await client.resume(session, url, token=token)
        return await asyncio.gather(*tasks)


def _prompt_ids(model_dir, texts: list[str]) -> list[list[int]]:
    tok = load_tokenizer(model_dir)
    chats = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False)
             for t in texts]  # fmt: skip
    return [tok(c, add_special_tokens=False)["input_ids"] for c in chats]


def _sp(seed: int, max_tokens: int = 8, **extra) -> dict:
    return {"temperature": 1.0, "max_tokens": max_tokens, "seed": seed, "ignore_eos": True, **extra}


def _one_turn(prompt: list[int], out) -> Trajectory:
    routing = RoutingTrace()
    routing.add(out.routed_experts, len(prompt), len(out.token_ids))
    tokens = prompt + out.token_ids
    return Trajectory(
        tokens=tokens, prompt_len=len(prompt), action_ranges=[(len(prompt), len(tokens))],
        action_logprobs=out.logprobs, versions=out.weight_versions, routed_experts=routing.rows(len(tokens)),
    )  # fmt: skip


def _trainer_pass(model, trajs: list[Trajectory], *, replay: bool):
    """(agreement over tokens with engine routing, trainer log-probs [B, T], experience) of one forward."""
    moe = MoeRouting(model, replay=replay, aux_coef=0.0, z_coef=0.0)
    exp = make_experience(trajs, max_len=256, pack=True)
    with torch.no_grad(), moe.micro_batch(exp):
        logits = model(input_ids=exp.sequences, position_ids=exp.position_ids, use_cache=False).logits
        moe.aux_loss(1.0)
    logp, _ = token_logprobs(logits, exp.sequences, mask=exp.action_mask)
    t = moe.totals
    return (t.same / t.known if t.known else None), logp, exp


def test_engine_returns_vllm_format(engine) -> None:
    url, token, model_dir = engine
    [prompt] = _prompt_ids(model_dir, PROMPTS[:1])
    [out] = asyncio.run(_generate_together(url, token, [(prompt, _sp(1, max_tokens=5))]))
    rows = out.routed_experts
    assert rows.shape == (len(prompt) + 5 - 1, 3, 2) and rows.dtype == np.uint8  # [P + G - 1, layers, top_k]
    assert (rows[:, 1] == 0).all()  # the dense block: zeros, as vLLM returns
    assert rows[:, [0, 2]].max() < 8 and (rows[:, 0, 0] != rows[:, 0, 1]).all()
    [skipped] = asyncio.run(
        _generate_together(url, token, [(prompt, _sp(1, max_tokens=5, routed_experts_prompt_start=4))])
    )
    assert np.array_equal(skipped.routed_experts, rows[4:])  # same seed, same tokens, the first 4 rows left out
    with pytest.raises(client.EngineHTTPError, match="routed_experts_prompt_start"):
        asyncio.run(_generate_together(url, token, [(prompt, _sp(1, routed_experts_prompt_start=len(prompt)))]))
    with pytest.raises(ValueError, match=r"base64 \.npy"):
        decode_routing("bm90IGFuIGFycmF5")


def test_engine_routing_equals_trainer_live_routing(engine) -> None:
    """Batched prefill (left padding), batched decode, the buffer's codec, packing: agreement 1.0."""
    url, token, model_dir = engine
    prompts = _prompt_ids(model_dir, PROMPTS)
    outs = asyncio.run(_generate_together(url, token, [(p, _sp(i)) for i, p in enumerate(prompts)]))
    trajs = [_one_turn(p, o) for p, o in zip(prompts, outs, strict=True)]
    trajs = decode_group(encode_group(Group("g", "p", trajs))).samples  # through the buffer's bytes
    model = load_causal_lm(model_dir)
    agreement, logp, exp = _trainer_pass(model, trajs, replay=True)
    assert agreement == 1.0
    assert exp.routed_experts.shape[2:] == (3, 2)
    engine_logp = exp.action_log_probs[exp.action_mask]
    assert torch.allclose(logp[exp.action_mask], engine_logp, atol=1e-5)


def test_multi_turn_first_turn_keeps_its_rows(engine) -> None:
    """Turn 2 asks only for positions turn 1 did not cover; the assembled rows equal the live routing."""
    url, token, model_dir = engine
    [p1] = _prompt_ids(model_dir, PROMPTS[1:2])
    routing = RoutingTrace()
    [o1] = asyncio.run(_generate_together(url, token, [(p1, _sp(3, max_tokens=4))]))
    routing.add(o1.routed_experts, len(p1), len(o1.token_ids))
    assert routing.have == len(p1) + 4 - 1
    feedback = load_tokenizer(model_dir)("\nagain:", add_special_tokens=False)["input_ids"]
    p2 = p1 + o1.token_ids + feedback
    sp2 = _sp(4, max_tokens=4, routed_experts_prompt_start=routing.have)
    [o2] = asyncio.run(_generate_together(url, token, [(p2, sp2)]))
    assert len(o2.routed_experts) == len(p2) + 4 - 1 - routing.have  # only the new positions
    routing.add(o2.routed_experts, len(p2), len(o2.token_ids))
    tokens = p2 + o2.token_ids
    rows = routing.rows(len(tokens))
    assert (rows[-1] == -1).all() and (rows[:-1] >= 0).all()
    traj = Trajectory(
        tokens=tokens, prompt_len=len(p1), action_ranges=[(len(p1), len(p1) + 4), (len(p2), len(tokens))],
        action_logprobs=o1.logprobs + o2.logprobs, versions=[0] * 8, routed_experts=rows,
    )  # fmt: skip
    agreement, logp, exp = _trainer_pass(load_causal_lm(model_dir), [traj], replay=True)
    assert agreement == 1.0
    assert torch.allclose(logp[exp.action_mask], exp.action_log_probs[exp.action_mask], atol=1e-5)
    lost = RoutingTrace()
    lost.add(o2.routed_experts, len(p2), len(o2.token_ids))  # rows for positions it did not ask to skip
    assert lost.rows(len(tokens)) is None  # a reply that does not line up drops the sample's routing


@pytest.fixture(scope="module")
def top1_engine(tmp_path_factory):
    """A top-1 tiny MoE: a token's output depends only on which expert it went to (its weight is 1)."""
    root = tmp_path_factory.mktemp("moe-top1")
    model_dir = _model(root / "model", top_k=1)
    run = make_run(root, "top1", model_dir, "actor.router_replay=true", "engines.max_batch=16")
    [proc] = start_engines(run, [0])
    yield proc.url, run.token(), model_dir
    assert proc.stop() == 0


def test_replay_keeps_engine_logprobs_after_the_router_moves(top1_engine) -> None:
    """The trainer's router moves (as one unfrozen optimizer step would): its live routing leaves the
    engine's for some tokens. Replaying the engine's experts gives exactly the engine's log-probs
    (top-1: the gate weight is 1 whatever the router); routing live does not."""
    url, token, model_dir = top1_engine
    prompts = _prompt_ids(model_dir, PROMPTS)
    outs = asyncio.run(_generate_together(url, token, [(p, _sp(10 + i)) for i, p in enumerate(prompts)]))
    trajs = [_one_turn(p, o) for p, o in zip(prompts, outs, strict=True)]
    same = load_causal_lm(model_dir)
    assert _trainer_pass(same, trajs, replay=True)[0] == 1.0
    moved = copy.deepcopy(same)
    gen = torch.Generator().manual_seed(0)
    for layer in moved.model.layers:
        gate = layer.mlp.gate.weight
        gate.data += 0.2 * gate.data.std() * torch.randn(gate.shape, generator=gen)
    agreement, replayed, exp = _trainer_pass(moved, trajs, replay=True)
    _, live, _ = _trainer_pass(moved, trajs, replay=False)
    mask, engine_logp = exp.action_mask, exp.action_log_probs
    assert 0.5 < agreement < 1.0  # the moved router disagrees with the engine on some tokens
    assert torch.allclose(replayed[mask], engine_logp[mask], atol=1e-5)
    assert (live[mask] - engine_logp[mask]).abs().max() > 1e-3


def test_config_and_flags(tmp_path) -> None:
    from molt_hpc.config import ConfigError, load_config
    from molt_hpc.engine.vllm.main import vllm_command

    cfg = load_config(None, ["actor.router_replay=true", "engines.kind=vllm", "actor.device=cuda"])
    assert "--enable-return-routed-experts" in vllm_command(cfg, tmp_path, 8000, 0)
    off = load_config(None, ["engines.kind=vllm", "actor.device=cuda"])
    assert "--enable-return-routed-experts" not in vllm_command(off, tmp_path, 8000, 0)
    spec = json.dumps(["--speculative-config={}"])
    with pytest.raises(ConfigError, match="speculative decoding"):
        load_config(None, ["actor.router_replay=true", "engines.kind=vllm", "actor.device=cuda",
                           f"engines.extra_args={spec}"])  # fmt: skip
