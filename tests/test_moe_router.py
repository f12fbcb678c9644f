"""The trainer's MoE routers: the class swap against stock transformers and a forward-hook reference,
gradients and activation checkpointing, freezing by class, aux losses against a reference loop, and
(in a child process with a gloo world) the fp32 gate FSDP unit under bf16 and the step's metrics."""

import copy
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from molt_hpc.actor.build import freeze_router
from molt_hpc.actor.moe_router import MoeRouting
from molt_hpc.algorithm import make_experience
from molt_hpc.config import MoltConfig
from molt_hpc.models import build_tiny_moe, load_causal_lm
from molt_hpc.models.moe import find_routers
from molt_hpc.models.router_replay import swap_routers
from molt_hpc.trajectory import Trajectory
from tests.conftest import ROOT

E, K = 8, 2


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(4, 104, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _forced_routing(n_tokens: int, layers: int, seed: int, unknown_every: int = 3) -> np.ndarray:
    """Random distinct top-2 experts per (token, layer); every `unknown_every`-th token -1 (live)."""
    gen = np.random.default_rng(seed)
    rows = np.stack([np.stack([gen.permutation(E)[:K] for _ in range(layers)]) for _ in range(n_tokens)])
    rows[::unknown_every] = -1
    return rows.astype(np.int16)


def _traj(n_tokens: int, seed: int, routed: np.ndarray | None) -> Trajectory:
    return Trajectory(
        tokens=_ids(n_tokens, seed), prompt_len=3, action_ranges=[(3, n_tokens)],
        action_logprobs=[0.0] * (n_tokens - 3), versions=[0] * (n_tokens - 3), routed_experts=routed,
    )  # fmt: skip


def _hook_reference(model, routed: torch.Tensor):
    """A stock model whose routers' outputs a forward hook replaces with `routed` [B*T, L, K] (-1: live)."""
    ref = copy.deepcopy(model)
    for r in find_routers(ref):

        def hook(module, args, output, layer=r.layer):
            logits, _, live = output
            probs = torch.softmax(logits.float(), -1)
            want = routed[:, layer].long()
            idx = torch.where((want >= 0).all(-1, keepdim=True), want, live)
            w = probs.gather(-1, idx)
            return logits, (w / w.sum(-1, keepdim=True)).to(logits.dtype), idx

        r.module.register_forward_hook(hook)
    return ref


def _forward(model, exp, moe: MoeRouting | None = None):
    kwargs = {"input_ids": exp.sequences, "position_ids": exp.position_ids, "use_cache": False}
    if moe is None:
        return model(**kwargs).logits
    with moe.micro_batch(exp):
        logits = model(**kwargs).logits
        moe.aux_loss(1.0)
    return logits


def test_swap_keeps_names_and_stock_outputs(tiny_moe_dir: Path) -> None:
    stock = load_causal_lm(tiny_moe_dir)
    swapped = copy.deepcopy(stock)
    routers = swap_routers(swapped)
    assert [r.layer for r in routers] == [0, 1] and type(routers[0].module).__name__ == "ReplayQwen3MoeTopKRouter"
    assert [n for n, _ in swapped.named_parameters()] == [n for n, _ in stock.named_parameters()]
    assert swapped.state_dict().keys() == stock.state_dict().keys()
    ids = torch.tensor([_ids(20, 0)])
    with torch.no_grad():
        a, b = stock(ids, output_router_logits=True), swapped(ids, output_router_logits=True)
    assert torch.equal(a.logits, b.logits)  # fp32: the same computation as transformers'
    assert len(b.router_logits) == 2
    half = copy.deepcopy(swapped).to(torch.bfloat16)
    with torch.no_grad():
        out = half(ids, output_router_logits=True)
    assert out.logits.dtype == torch.bfloat16 and all(x.dtype == torch.float32 for x in out.router_logits)


def test_replay_equals_a_hook_reference_and_keeps_live_where_unknown(tiny_moe_dir: Path) -> None:
    model = load_causal_lm(tiny_moe_dir)
    trajs = [_traj(n, i, _forced_routing(n, 2, i)) for i, n in enumerate((17, 11, 14))]
    exp = make_experience(trajs, max_len=64)  # right-padded rows: padding is -1 too
    routed = exp.routed_experts.reshape(-1, 2, K)
    reference = _hook_reference(model, routed)
    moe = MoeRouting(model, replay=True, aux_coef=0.0, z_coef=0.0)
    with torch.no_grad():
        want, got = _forward(reference, exp), _forward(model, exp, moe)
        live = _forward(load_causal_lm(tiny_moe_dir), exp)
    assert torch.allclose(got, want, atol=1e-5)
    real = exp.attention_mask
    assert (got[real] - live[real]).abs().max() > 1e-3  # the forced experts changed the output
    # replaying the model's own live routing reproduces it exactly
    seen = {}
    for r in find_routers(model):
        r.module.register_forward_hook(lambda m, a, out, layer=r.layer: seen.__setitem__(layer, out[2]))
    with torch.no_grad():
        _forward(model, exp)
    own = torch.stack([seen[0], seen[1]], 1).reshape(*exp.sequences.shape, 2, K).to(torch.int16)
    replayed = copy.copy(exp)
    replayed.routed_experts = own
    moe = MoeRouting(model, replay=True, aux_coef=0.0, z_coef=0.0)
    with torch.no_grad():
        assert torch.equal(_forward(model, replayed, moe), live)
    assert moe.totals.same == moe.totals.known == 2 * int(real.sum())


def test_router_gets_gradients_and_checkpointing_recomputes_the_same(tiny_moe_dir: Path) -> None:
    trajs = [_traj(n, i, _forced_routing(n, 2, 10 + i)) for i, n in enumerate((15, 12))]
    exp = make_experience(trajs, max_len=64)

    def loss_and_grads(checkpointing: bool):
        model = load_causal_lm(tiny_moe_dir).train()
        if checkpointing and hasattr(model, "activation_checkpointing_enable"):  # transformers renamed it
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        elif checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        moe = MoeRouting(model, replay=True, aux_coef=0.1, z_coef=0.01)
        with moe.micro_batch(exp):
            loss = _forward(model, exp).float().pow(2).mean() + moe.aux_loss(1.0)
            loss.backward()
        assert moe.totals.tokens == int(exp.attention_mask.sum())  # recorded once, not again in recompute
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    loss, grads = loss_and_grads(False)
    assert grads["model.layers.0.mlp.gate.weight"].abs().sum() > 0  # weights come from the live softmax
    loss_ac, grads_ac = loss_and_grads(True)
    assert torch.allclose(loss, loss_ac, atol=1e-6)
    for name, g in grads.items():
        assert torch.allclose(g, grads_ac[name], atol=1e-6), name


def test_freezing_is_by_router_class(tmp_path: Path, tiny_model_dir: Path) -> None:
    spec = MoltConfig().model.tiny_moe.model_copy(update={"num_layers": 3, "dense_layers": [1]})
    model = load_causal_lm(build_tiny_moe(tmp_path / "m", spec))
    assert freeze_router(model) == ["model.layers.0.mlp.gate.weight", "model.layers.2.mlp.gate.weight"]
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen == {"model.layers.0.mlp.gate.weight", "model.layers.2.mlp.gate.weight"}
    assert "model.layers.1.mlp.gate_proj.weight" not in frozen  # a dense MLP's gate projection trains
    assert freeze_router(load_causal_lm(tiny_model_dir)) == []  # a dense model has no router
    # Llama 4 records no router_logits: its router is found by the MoE block's shape (hidden -> one
    # logit per expert, next to `experts`), frozen, and refused for replay (its rule is not softmax -> top-k).
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    llama4 = Llama4ForCausalLM(Llama4TextConfig(
        vocab_size=104, hidden_size=64, intermediate_size=64, intermediate_size_mlp=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_local_experts=4, num_experts_per_tok=1,
    ))  # fmt: skip
    assert freeze_router(llama4) == [f"model.layers.{i}.feed_forward.router.weight" for i in (0, 1)]
    with pytest.raises(ValueError, match="does not route by softmax -> top-k"):
        MoeRouting.for_policy(llama4, MoltConfig(actor={"router_replay": True}))
    assert MoeRouting.for_policy(llama4, MoltConfig()) is None  # nothing asked: it trains as transformers runs it
    with pytest.raises(ValueError, match="has no MoE router"):
        MoeRouting.for_policy(load_causal_lm(tiny_model_dir), MoltConfig(actor={"router_replay": True}))
    assert MoeRouting.for_policy(load_causal_lm(tiny_model_dir), MoltConfig()) is None


def _reference_aux(logits: list[torch.Tensor], chosen: list[torch.Tensor], mask: list[bool]) -> tuple[float, float]:
    """Switch load balancing and the z-loss as plain loops over layers, tokens and experts."""
    lbs, zs = [], []
    for lg, ch in zip(logits, chosen, strict=True):
        rows = [i for i, m in enumerate(mask) if m]
        f, p, z = [0.0] * E, [0.0] * E, 0.0
        for t in rows:
            values = lg[t].tolist()
            top = max(values)
            total = sum(math.exp(v - top) for v in values)
            for e in range(E):
                p[e] += math.exp(values[e] - top) / total / len(rows)
            for e in ch[t].tolist():
                f[e] += 1.0 / (len(rows) * K)
            z += (top + math.log(total)) ** 2 / len(rows)
        lbs.append(E * sum(fi * pi for fi, pi in zip(f, p, strict=True)))
        zs.append(z)
    return sum(lbs) / len(lbs), sum(zs) / len(zs)


def test_aux_losses_match_a_reference_loop(tiny_moe_dir: Path) -> None:
    """From the trainer's router logits, over real tokens only, with replayed experts as the selection."""
    model = load_causal_lm(tiny_moe_dir)
    trajs = [_traj(n, 20 + i, _forced_routing(n, 2, 20 + i)) for i, n in enumerate((13, 9))]
    exp = make_experience(trajs, max_len=64)
    seen = {}
    for r in find_routers(model):
        r.module.register_forward_hook(lambda m, a, out, layer=r.layer: seen.__setitem__(layer, out))
    moe = MoeRouting(model, replay=True, aux_coef=1.0, z_coef=0.0)
    with moe.micro_batch(exp):
        _forward(model, exp)
        aux = moe.aux_loss(1.0)
    zmoe = MoeRouting(model, replay=True, aux_coef=0.0, z_coef=1.0)
    with zmoe.micro_batch(exp):
        _forward(model, exp)
        z = zmoe.aux_loss(0.5)
    logits = [seen[layer][0].detach() for layer in (0, 1)]
    chosen = [seen[layer][2] for layer in (0, 1)]
    flat = exp.routed_experts.reshape(-1, 2, K).long()
    known = (flat[:, 0] >= 0).all(-1)
    assert torch.equal(chosen[0][known], flat[known, 0])  # the replayed experts are the selection
    want_lb, want_z = _reference_aux(logits, chosen, exp.attention_mask.reshape(-1).tolist())
    assert aux.item() == pytest.approx(want_lb, rel=1e-5)
    assert z.item() == pytest.approx(0.5 * want_z, rel=1e-5)  # weighted by the micro-batch's token share
    assert moe.totals.aux / moe.totals.tokens == pytest.approx(want_lb, rel=1e-5)
    aux.backward()
    assert find_routers(model)[0].module.weight.grad.abs().sum() > 0


def fsdp_child(model_dir: Path, out: Path) -> None:
    """World of one: the fp32 gate unit inside bf16 blocks, then the step's metrics (a collective)."""
    import torch.nn.functional as F

    from molt_hpc.actor.world import init_world
    from molt_hpc.config.train import ActorConfig
    from molt_hpc.parallel import parallelize

    world = init_world(ActorConfig(device="cpu"))
    model = load_causal_lm(model_dir).train()
    master = {r.layer: r.module.weight.detach().clone() for r in find_routers(model)}
    moe = MoeRouting(model, replay=True, aux_coef=0.01, z_coef=0.0)
    parallelize(model, world.mesh, ActorConfig(), compute_dtype=torch.bfloat16)
    seen = {}
    for r in find_routers(model):
        r.module.register_forward_hook(lambda m, args, o, layer=r.layer: seen.__setitem__(layer, (args[0], o)))
    experts_in = []
    model.model.layers[0].mlp.experts.register_forward_hook(lambda m, args, o: experts_in.append(args[0].dtype))
    trajs = [_traj(n, 30 + i, _forced_routing(n, 2, 30 + i)) for i, n in enumerate((12, 16))]
    exp = make_experience(trajs, max_len=64)
    with moe.micro_batch(exp):
        loss = model(input_ids=exp.sequences, position_ids=exp.position_ids, use_cache=False).logits.float().mean()
        (loss + moe.aux_loss(1.0)).backward()
    h, (logits, weights, _) = seen[0]
    result = {
        "gate_input": str(h.dtype), "logits": str(logits.dtype), "weights": str(weights.dtype),
        "experts_input": str(experts_in[0]),
        "fp32_master": bool(torch.equal(logits, F.linear(h.float(), master[0]))),
        "bf16_differs": bool(not torch.equal(logits, F.linear(h.float(), master[0].bfloat16().float()))),
        "chosen": [seen[layer][1][2].tolist() for layer in (0, 1)],
        "mask": exp.attention_mask.reshape(-1).tolist(),
        "metrics": moe.step_metrics(exp),
    }  # fmt: skip
    out.write_text(json.dumps(result))
    torch.distributed.destroy_process_group()


def test_fp32_gate_unit_under_bf16_and_step_metrics(tiny_moe_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.test_moe_router", str(tiny_moe_dir), str(out)],
        cwd=ROOT, env={**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
        timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(out.read_text())
    assert (r["gate_input"], r["experts_input"]) == ("torch.bfloat16", "torch.bfloat16")  # the blocks run bf16
    assert (r["logits"], r["weights"]) == ("torch.float32", "torch.bfloat16")
    assert r["fp32_master"] and r["bf16_differs"]  # logits from the fp32 master weight, not a bf16 copy
    mask = np.array(r["mask"])
    loads = [np.bincount(np.array(c)[mask].reshape(-1), minlength=E) for c in r["chosen"]]
    m = r["metrics"]
    assert m["moe_load_imbalance"] == pytest.approx(np.mean([x.max() / x.mean() for x in loads]))
    assert m["replayed_tokens"] == sum(n - len(range(0, n, 3)) for n in (12, 16))  # every third token is -1
    assert 0.0 <= m["routing_agreement"] < 0.5  # random forced experts rarely match the live top-2
    assert m["unreplayed_samples"] == 0 and m["moe_aux_loss"] > 0


if __name__ == "__main__":
    from molt_hpc.log import end_process

    torch.set_num_threads(1)
    fsdp_child(Path(sys.argv[1]), Path(sys.argv[2]))
    end_process(0)  # past the interpreter teardown, which torch's gloo threads do not survive
