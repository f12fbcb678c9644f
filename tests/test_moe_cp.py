"""Router replay under Ulysses context parallelism over packed rows: two gloo ranks (cp = 2) move an MoE
model's weights exactly as one plain process replaying the same routing on padded rows.

Each CP rank's routers see its slice of every row, so the replayed experts must be sliced like the
tokens; a misaligned slice would send tokens to other experts and change the gradient (or trip the
router's shape check). Real parts: a transformers Qwen3-MoE from a config, `molt_hpc.actor`'s packing,
attention, FSDP2 and step, 2-process gloo groups (`torch.multiprocessing.spawn`).
"""

import os

import numpy as np
import pytest
import torch
import torch.distributed as dist

from molt_hpc.actor.moe_router import MoeRouting
from molt_hpc.algorithm import compute_advantages, experience_from_groups, policy_loss
from tests.ranks import spawn_ranks
from tests.test_actor_cp import V, config, groups, reference_logprobs

E, K, LAYERS = 4, 2, 2


def moe_model():
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=V, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                         num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         num_experts=E, num_experts_per_tok=K, norm_topk_prob=True, pad_token_id=0,
                         tie_word_embeddings=False)  # fmt: skip
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa").train()


def routed_groups():
    """`test_actor_cp`'s groups with engine routing: random distinct experts, every fourth token unknown."""
    gen = np.random.default_rng(0)
    out = groups()
    for g in out:
        for s in g.samples:
            rows = np.array([[gen.permutation(E)[:K] for _ in range(LAYERS)] for _ in s.tokens], dtype=np.int16)
            rows[::4] = -1
            s.routed_experts = rows
    return out


def _rank_main(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))  # fmt: skip
    from molt_hpc.actor import build
    from molt_hpc.actor.packing import sequence_layout
    from molt_hpc.actor.state import Trainable
    from molt_hpc.actor.step import Meter, Models, build_experience, update_policy
    from molt_hpc.actor.world import init_world
    from molt_hpc.config.train import ActorConfig
    from molt_hpc.parallel import parallelize

    world = init_world(ActorConfig(device="cpu", cp=2))
    cfg = config("actor.cp=2", "actor.packing='on'", "actor.max_tokens_per_micro_batch=64", "actor.router_replay=true",
                 "actor.freeze_router=false", "actor.activation_checkpointing=true")  # fmt: skip
    model = moe_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    moe = MoeRouting.for_policy(model, cfg)
    docs, pack_tokens = sequence_layout(cfg, world, model)
    parallelize(model, world.mesh, cfg.actor, documents=docs)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    models = Models(Trainable("policy", model, opt, build.build_scheduler(opt, cfg.actor, 10)), moe=moe,
                    pack_tokens=pack_tokens)  # fmt: skip
    exp = build_experience(routed_groups(), cfg, models, world, pad_id=0)
    update_policy(exp, cfg, models, world, Meter())
    metrics = moe.step_metrics(exp)
    moved = {n: p.full_tensor() - before[n] for n, p in model.named_parameters()}
    dist.destroy_process_group()
    if rank == 0:
        torch.save({"moved": moved, "metrics": metrics, "packed": pack_tokens is not None}, out)


def reference(cfg):
    """-gradient of the step's loss and the routing metrics' counts on one process, padded rows."""
    plain = moe_model()
    moe = MoeRouting(plain, replay=True, aux_coef=0.0, z_coef=0.0)
    exp = compute_advantages(experience_from_groups(routed_groups(), max_len=64), cfg.algorithm)
    with moe.micro_batch(exp):
        lp, ent = reference_logprobs(plain, exp, cfg.rollout.temperature)
        loss, _ = policy_loss(lp, exp.action_log_probs, exp.advantages, exp.action_mask, cfg.algorithm,
                              int(exp.action_mask.sum()), seq_index=exp.seq_index, n_samples=exp.num_samples,
                              entropy=ent)  # fmt: skip
        moe.aux_loss(1.0)
        loss.backward()
    return {n: -p.grad for n, p in plain.named_parameters()}, moe.totals


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cp2_packed_replay_moves_the_weights_as_one_plain_process(tmp_path) -> None:
    from molt_hpc.net import free_port

    out = tmp_path / "ranks.pt"
    spawn_ranks(_rank_main, (free_port("127.0.0.1"), str(out)), 2)
    got = torch.load(out, weights_only=False)
    assert got["packed"]
    want, totals = reference(config("actor.router_replay=true"))
    assert want["model.layers.0.mlp.gate.weight"].abs().max() > 1e-4  # the router trains through replay
    for name, w in want.items():
        assert torch.allclose(got["moved"][name], w, atol=1e-6, rtol=0), (name, (got["moved"][name] - w).abs().max())
    m = got["metrics"]
    assert m["replayed_tokens"] == totals.known / LAYERS  # every engine-routed token, once, over the CP slices
    assert m["routing_agreement"] == pytest.approx(totals.same / totals.known, abs=0.02)
