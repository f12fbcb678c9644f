"""Expert parallelism on real gloo groups: EP = 2 and 4 give the one-process loss, gradients and weights.

One world of 4 gloo ranks runs every case: it shards a tiny Qwen3-MoE (8 experts, top-2, built here
from `Qwen3MoeConfig`) with `actor.ep = ep` (FSDP over the remaining `4 / ep` ranks when there are
some), trains one step on their share of a batch with the trainer's loss scaling (each rank's loss
over the global token count, times the world size), clip through the trainer's `optimizer_step`,
then saves a checkpoint and gathers the refit tensors. The reference is the plain model on the whole
batch in this process.
"""

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from molt_hpc.config.train import ActorConfig
from molt_hpc.parallel import parallelize
from molt_hpc.refit.experts import expert_views
from tests.ranks import spawn_ranks

VOCAB, ROWS, COLS, LR, CLIP = 50, 8, 12, 0.5, 0.05


def tiny_moe():
    """A two-layer Qwen3-MoE (8 experts, top-2) with routers spread enough that every expert gets tokens."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        head_dim=32, intermediate_size=64, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
    return model


def batch() -> torch.Tensor:
    return torch.randint(0, VOCAB, (ROWS, COLS), generator=torch.Generator().manual_seed(1))


def loss_of(model, ids: torch.Tensor, count: int) -> torch.Tensor:
    logits = model(input_ids=ids).logits[:, :-1].float()
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1), reduction="sum") / count


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def use_fake_deep_ep(model) -> None:
    """Switch the EP experts to the DeepEP dispatch, DeepEP's buffer replaced by the gloo fake, fp32 on the wire."""
    from transformers.integrations.moe import ExpertsInterface

    from molt_hpc.parallel import deepep
    from molt_hpc.parallel.expert import IMPLEMENTATIONS
    from tests.fake_deep_ep import FakeDeepEPBuffer

    buffers = {}
    deepep.WIRE_DTYPE = torch.float32
    deepep.buffer_for = lambda group, _bytes: buffers.setdefault(group, FakeDeepEPBuffer(group, 8))
    ExpertsInterface.register(IMPLEMENTATIONS["deep_ep"], deepep.deep_ep_forward)
    model.set_experts_implementation(IMPLEMENTATIONS["deep_ep"])


WORLD = 4
CASES = {
    "ep2-fsdp2": (2, "all_to_all"),
    "ep4": (4, "all_to_all"),
    "ep2-fsdp2-activation-checkpointing": (2, "all_to_all"),
    "ep4-deep_ep-fake": (4, "deep_ep-fake"),
}
"""Run one after the other in one world of 4 ranks (the fake DeepEP last: it patches the dispatch module)."""


def _rank_main(rank: int, world: int, store: str, out: str) -> None:
    os.environ["LOCAL_WORLD_SIZE"] = str(world)  # one node
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        for case, (ep, dispatch) in CASES.items():
            _case(rank, world, ep, dispatch, Path(out) / case)
    finally:
        dist.destroy_process_group()


def _case(rank: int, world: int, ep: int, dispatch: str, out: Path) -> None:
    from molt_hpc.actor.state import Trainable, save_model
    from molt_hpc.actor.step import optimizer_step
    from molt_hpc.actor.weights import full_tensor
    from molt_hpc.actor.world import World
    from molt_hpc.parallel.expert_gather import refit_metas, refit_tensors

    model, ids = tiny_moe(), batch()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    parallelize(model, mesh, ActorConfig(ep=ep, activation_checkpointing="checkpointing" in out.name))
    if dispatch == "deep_ep-fake":
        use_fake_deep_ep(model)
    experts = model.model.layers[0].mlp.experts.gate_up_proj
    assert experts.to_local().shape[0] <= 8 // ep, "each EP rank holds at most its E/ep experts"
    loss = loss_of(model, ids[rank::world], ids[:, 1:].numel())
    (loss * world).backward()
    grads = {n: _whole(p.grad) for n, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    norm = optimizer_step(Trainable("policy", model, opt, None), CLIP)
    total = loss.detach().clone()
    dist.all_reduce(total)
    # As EngineSync.refit: EP experts go out per expert under HF names, in the order of the metadata.
    refit = list(refit_tensors(model, None, lambda p, d: full_tensor(p, d)[0]))
    metas = refit_metas(model, torch.float32)
    world_obj = World(rank=rank, size=world, device=torch.device("cpu"), mesh=mesh)
    save_model(world_obj, model, out / "ckpt", tokenizer_src=out, shard_bytes=64 << 10)
    if rank == 0:
        assert [(n, tuple(t.shape)) for n, t in refit] == [(m.name, m.shape) for m in metas]
        refit = {n: t.clone() for n, t in refit}
        torch.save({"loss": total, "grads": grads, "norm": norm, "refit": refit}, out / "result.pt")


@pytest.fixture(scope="module")
def reference():
    """Loss, gradients, gradient norm and weights after one clipped SGD step of the plain model."""
    model, ids = tiny_moe(), batch()
    loss = loss_of(model, ids, ids[:, 1:].numel())
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    norm = torch.nn.utils.clip_grad_norm_(list(model.parameters()), CLIP)
    torch.optim.SGD(model.parameters(), lr=LR).step()
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"loss": float(loss.detach()), "grads": grads, "norm": float(norm), "weights": weights}


@pytest.fixture(scope="module")
def ep_runs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ep")
    spawn_ranks(_rank_main, (WORLD, str(out / "store"), str(out)), WORLD)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_expert_parallel_equals_one_process(ep_runs: Path, reference, case: str) -> None:
    """`deep_ep-fake`: the DeepEP dispatch's autograd wiring with DeepEP's buffer replaced by a gloo fake."""
    tmp_path = ep_runs / case
    got = torch.load(tmp_path / "result.pt")
    assert abs(float(got["loss"]) - reference["loss"]) < 1e-6
    for name, want in reference["grads"].items():
        torch.testing.assert_close(got["grads"][name], want, atol=1e-6, rtol=0, msg=name)
    assert abs(got["norm"] - reference["norm"]) < 1e-6
    assert reference["norm"] > CLIP, "the step must clip for the norm to matter"
    ckpt = {}
    for f in sorted((tmp_path / "ckpt").glob("*.safetensors")):
        ckpt.update(load_file(f))
    assert len(list((tmp_path / "ckpt").glob("*.safetensors"))) > 2, "small shards: several buckets"
    assert set(ckpt) == set(reference["weights"])
    for name, want in reference["weights"].items():
        torch.testing.assert_close(ckpt[name], want, atol=1e-6, rtol=0, msg=name)
    assert ckpt["model.layers.1.mlp.experts.down_proj"].shape == (8, 64, 32)
    # The refit: fused experts per expert (gate_proj/up_proj/down_proj of each), loaded the built-in
    # engine's way into a fresh model (its fused parameters through per-expert views) = the reference.
    refit = got["refit"]
    assert (
        "model.layers.0.mlp.experts.5.up_proj.weight" in refit
        and "model.layers.0.mlp.experts.gate_up_proj" not in refit
    )
    assert max(t.numel() for n, t in refit.items() if ".experts." in n) == 32 * 64, "one expert matrix at most"
    engine = tiny_moe()
    targets = {**engine.state_dict(keep_vars=True), **expert_views(engine)}
    assert set(refit) <= set(targets)
    with torch.no_grad():
        for name, t in refit.items():
            targets[name].copy_(t)
    covered = {n for n in refit if ".experts." not in n} | {n for n, _ in engine.named_parameters() if ".experts." in n}
    assert covered == set(reference["weights"])
    for name, p in engine.named_parameters():
        torch.testing.assert_close(p.detach(), reference["weights"][name], atol=1e-6, rtol=0, msg=name)
