"""`actor.offload` on 2 real gloo ranks: the same training as without offload.

Each rank trains the tiny policy (with a KL reference) for 3 steps on the same sampled groups under
`none`, `full` (FSDP2's CPU offload policy on the policy and the reference, fused AdamW on the host
copies) and `optimizer`. On a CPU trainer `optimizer` installs nothing (the state is in host
memory already), so the offloader is installed by hand here: its copies then go host to host, which
still runs everything it does but the device transfer (the GPU test and `bench/gpu_offload.py`
cover that).
"""

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

STEPS = 3


def _train(cfg, world, groups, offloader: bool) -> dict:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from molt_hpc.actor import build
    from molt_hpc.actor.offload import OptimizerOffload
    from molt_hpc.actor.state import Trainable
    from molt_hpc.actor.step import Models, train_step

    torch.manual_seed(0)
    policy = build.load_model(Path(cfg.model.path), cfg, world, "policy")
    opt = build.build_optimizer(policy, cfg.actor, cfg.actor.lr)
    off = OptimizerOffload(opt, world.device) if offloader else None
    models = Models(policy=Trainable("policy", policy, opt, build.build_scheduler(opt, cfg.actor, STEPS)))
    models.reference = build.load_model(Path(cfg.model.path), cfg, world, "reference")
    out = {
        "loss": [],
        "grad_norm": [],
        "kl": [],
        "initial": {n: p.full_tensor().detach() for n, p in policy.named_parameters()},
    }
    for step in range(STEPS):
        metrics = train_step(groups[step::STEPS], cfg, models, world, pad_id=0)
        for key in ("loss", "grad_norm", "kl"):
            out[key].append(metrics[key])
        if off is not None:  # between steps every moment is one of the offloader's host buffers
            held = {id(b) for b in off.host.values()}
            moments = [v._local_tensor for s in opt.state.values() for k, v in s.items() if k != "step"]
            assert moments and all(id(m) in held for m in moments)
    osd = get_optimizer_state_dict(policy, opt)
    out["exp_avg_sq"] = sum(float(s["exp_avg_sq"].full_tensor().sum()) for s in osd["state"].values())
    out["params"] = {n: p.full_tensor().detach() for n, p in policy.named_parameters()}
    out["fused"] = bool(opt.defaults.get("fused"))
    return out


def _rank(rank: int, store: str, model_dir: str, groups, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from molt_hpc.actor.world import World
    from molt_hpc.config import load_config

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    world = World(rank, 2, torch.device("cpu"), init_device_mesh("cpu", (2,)))
    results = {}
    for mode in ["none", "full", "optimizer"]:
        sets = [f"actor.offload='{mode}'", "actor.device='cpu'", "actor.micro_batch_size=2", "actor.lr=1e-2",
                "algorithm.kl_coef=0.1", "actor.groups_per_step=1", "rollout.n_samples=4"]  # fmt: skip
        cfg = load_config(None, [*sets, f"model.path='{model_dir}'"])
        results[mode] = _train(cfg, world, groups, offloader=mode == "optimizer")
    if rank == 0:
        torch.save(results, out)
    dist.destroy_process_group()


@pytest.mark.timeout(300)
def test_offload_modes_train_the_same(tiny_model_dir, tmp_path):
    from tests.test_actor_support import sample_groups

    groups = sample_groups(tiny_model_dir, STEPS, 4, seed=3)
    out = tmp_path / "results.pt"
    mp.spawn(_rank, args=(str(tmp_path / "store"), str(tiny_model_dir), groups, str(out)), nprocs=2, join=True)
    res = torch.load(out)
    base = res["none"]
    assert base["loss"][0] != 0 and base["grad_norm"][0] > 0 and max(base["kl"]) > 0  # it trained
    moved = max(float((p - base["initial"][n]).abs().max()) for n, p in base["params"].items())
    assert moved > 1e-2, moved  # the updates are far larger than the tolerance below
    assert not base["fused"] and res["full"]["fused"]  # on the host under full offload: the fused CPU kernel
    for mode in ["full", "optimizer"]:
        got = res[mode]
        for key in ["loss", "grad_norm", "kl"]:
            assert got[key] == pytest.approx(base[key], rel=1e-5, abs=1e-7), (mode, key)
        assert got["exp_avg_sq"] == pytest.approx(base["exp_avg_sq"], rel=1e-5)
        for name, p in base["params"].items():
            # fused (full) and foreach (none) AdamW round differently: ~2e-6 after 3 steps of ~1e-2 each
            assert torch.allclose(got["params"][name], p, atol=2e-5, rtol=0), (mode, name)
