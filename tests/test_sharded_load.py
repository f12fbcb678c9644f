"""Sharded loading on real gloo groups of 2 and 3 processes against transformers' `from_pretrained`.

The parent writes tiny checkpoints with `save_pretrained` (bf16, several files; the MoE in
transformers' per-expert layout) and loads each with `from_pretrained` in fp32 as the expected
values. Each rank builds the model on the meta device, shards it with the trainer's `parallelize`,
reads its slices, then reports the gathered parameters, the buffers, logits of a forward and what
it read. Shapes are chosen so nothing divides evenly by 3 (vocab 100, hidden 40, 5 experts).
"""

import pytest
import torch
import torch.distributed as dist

from molt_hpc.actor.memory import host_peak_bytes, reset_host_peak
from tests.ranks import spawn_ranks

IDS = torch.tensor([[3, 17, 42, 8, 99, 0, 5, 61, 23, 77, 14, 9]])
POS = torch.arange(IDS.shape[1])[None]
ROPE_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16}  # fmt: skip
MOE = {"moe_intermediate_size": 12, "num_experts": 5, "num_experts_per_tok": 2, "head_dim": 8}


def configs() -> dict:
    from transformers import LlamaConfig, Qwen2Config, Qwen3MoeConfig

    small = dict(vocab_size=100, hidden_size=40, intermediate_size=34, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    return {
        "qwen2-tied": Qwen2Config(**small, tie_word_embeddings=True),
        "qwen2-untied": Qwen2Config(**small, tie_word_embeddings=False),
        "llama-rope-scaling": LlamaConfig(**small, rope_scaling=ROPE_SCALING),
        "qwen3-moe": Qwen3MoeConfig(**small, **MOE, tie_word_embeddings=False),
        # wide enough that a forward's memory is noise next to the weights (the host-memory check)
        "wide": Qwen2Config(**{**small, "vocab_size": 24001, "hidden_size": 256, "num_hidden_layers": 1}),
    }


def write_checkpoints(root) -> dict:
    from transformers import AutoModelForCausalLM

    paths = {}
    for i, (name, config) in enumerate(configs().items()):
        torch.manual_seed(i)
        model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
        paths[name] = root / name
        model.save_pretrained(paths[name], max_shard_size="40KB" if name != "wide" else "8MB")
    return paths


def expected(path, dtype=torch.float32) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, local_files_only=True).eval()
    with torch.no_grad():
        logits = model(input_ids=IDS, position_ids=POS, use_cache=False).logits
    return {"params": dict(model.named_parameters()), "buffers": dict(model.named_buffers()), "logits": logits}


def _report(model, stats, world) -> dict:
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        logits = model(input_ids=IDS, position_ids=POS, use_cache=False).logits
    params = {n: p.full_tensor() if isinstance(p, DTensor) else p for n, p in model.named_parameters()}
    return {"params": params, "buffers": {n: b.clone() for n, b in model.named_buffers()}, "logits": logits,
            "read": stats.bytes_read, "total": stats.bytes_total}  # fmt: skip


def _rank(rank: int, size: int, store: str, paths: dict, out: str, cases: list[str]) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from molt_hpc.actor.state import save_model
    from molt_hpc.actor.world import World
    from molt_hpc.config.train import ActorConfig
    from molt_hpc.models.sharded import is_tied, load_sharded
    from molt_hpc.parallel import parallelize

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=size)
    world = World(rank, size, torch.device("cpu"), init_device_mesh("cpu", (size,)))

    def load(path, **kw):
        dtype = kw.pop("dtype", torch.float32)
        shard = lambda m: parallelize(m, world.mesh, ActorConfig(), compute_dtype=dtype)  # noqa: E731
        return load_sharded(path, shard=shard, device=world.device, dtype=dtype, **kw)

    results = {}
    if "wide" in cases:  # first, so the high-water mark sees this load alone
        import transformers.models.qwen2.modeling_qwen2  # noqa: F401 - imported before measuring
        from transformers import AutoModelForCausalLM

        reset_host_peak()
        base = host_peak_bytes()
        model, stats = load(paths["wide"])
        sharded_peak = host_peak_bytes() - base
        del model
        reset_host_peak()
        base = host_peak_bytes()
        full = AutoModelForCausalLM.from_pretrained(str(paths["wide"]), dtype=torch.float32, local_files_only=True)
        full_peak = host_peak_bytes() - base
        del full
        results["wide"] = {"read": stats.bytes_read, "total": stats.bytes_total, "sharded_peak": sharded_peak,
                           "full_peak": full_peak}  # fmt: skip
    for name in [c for c in cases if c in ("qwen2-tied", "qwen2-untied", "llama-rope-scaling", "qwen3-moe")]:
        model, stats = load(paths[name])
        results[name] = {**_report(model, stats, world), "tied": is_tied(model)}
        if name in ("qwen3-moe", "qwen2-tied"):  # our own checkpoint (fused expert names), resumed the same way
            own = paths[name].parent / f"own-{name}-{size}"
            save_model(world, model, own, tokenizer_src=paths[name], shard_bytes=20_000)
            dist.barrier()
            results[f"{name}-own"] = _report(*load(own), world)
    if "bf16" in cases:
        results["bf16"] = _report(*load(paths["llama-rope-scaling"], dtype=torch.bfloat16), world)
    if "critic" in cases:
        critic, stats = load(paths["qwen2-untied"], critic=True, seed=7)
        results["critic"] = _report(critic, stats, world)
    torch.save(results, f"{out}.{rank}")
    dist.destroy_process_group()


def _spawn(tmp_path, paths, size: int, cases: list[str]) -> list[dict]:
    out = tmp_path / f"world{size}"
    spawn_ranks(_rank, (size, str(tmp_path / f"store{size}"), paths, str(out), cases), size)
    return [torch.load(f"{out}.{r}") for r in range(size)]


def _same(got: dict, want: dict, what: str, atol: float = 0.0) -> None:
    assert got.keys() == want.keys(), (what, sorted(set(got) ^ set(want)))
    for n, t in want.items():
        assert got[n].dtype == t.dtype, (what, n, got[n].dtype, t.dtype)
        assert torch.allclose(got[n].float(), t.float(), atol=atol, rtol=0), (what, n, (got[n] - t).abs().max())


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("sharded")
    return root, write_checkpoints(root)


@pytest.fixture(scope="module")
def three(ckpts):
    """Every case on 3 ranks (one world: process start-up is the expensive part)."""
    cases = ["wide", "qwen2-tied", "qwen2-untied", "llama-rope-scaling", "qwen3-moe", "bf16", "critic"]
    return _spawn(*ckpts, 3, cases)


@pytest.fixture(scope="module")
def two(ckpts):
    return _spawn(*ckpts, 2, ["critic"])


@pytest.mark.slow  # the worlds of 3 (and 2) processes these tests share take most of a minute
@pytest.mark.parametrize("name", ["qwen2-tied", "qwen2-untied", "llama-rope-scaling", "qwen3-moe"])
def test_three_uneven_ranks_equal_from_pretrained(ckpts, three, name):
    want = expected(ckpts[1][name])
    for r, got in enumerate(three):
        _same(got[name]["params"], want["params"], f"{name} params, rank {r}")
        _same(got[name]["buffers"], want["buffers"], f"{name} buffers, rank {r}")
        _same({"logits": got[name]["logits"]}, {"logits": want["logits"]}, f"{name} logits", atol=1e-5)
        assert got[name]["tied"] == (name == "qwen2-tied")
    # every byte of the model read once over the ranks, each rank about a third of them
    reads = [got[name]["read"] for got in three]
    assert sum(reads) == three[0][name]["total"], reads
    assert max(reads) <= 0.4 * three[0][name]["total"], reads


def test_moe_checkpoint_holds_per_expert_tensors(ckpts):
    """The MoE case reads transformers' own on-disk layout: one tensor per expert, not the fused names."""
    from molt_hpc.checkpoint import model_shapes

    names = set(model_shapes(ckpts[1]["qwen3-moe"]))
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in names
    assert not any(n.endswith("experts.gate_up_proj") for n in names)


@pytest.mark.slow  # the worlds of 3 (and 2) processes these tests share take most of a minute
@pytest.mark.parametrize("name", ["qwen2-tied", "qwen3-moe"])
def test_our_own_checkpoints_load_the_same_way(three, name):
    """Written by the trainer's `save_model` (fused expert names) and read back sharded: resume."""
    for r, got in enumerate(three):
        _same(got[f"{name}-own"]["params"], got[name]["params"], f"{name} from our checkpoint, rank {r}")
        _same(got[f"{name}-own"]["buffers"], got[name]["buffers"], f"{name} buffers from ours, rank {r}")


@pytest.mark.slow  # the worlds of 3 (and 2) processes these tests share take most of a minute
def test_reference_in_bf16_equals_from_pretrained_in_bf16(ckpts, three):
    want = expected(ckpts[1]["llama-rope-scaling"], torch.bfloat16)
    for got in three:
        _same(got["bf16"]["params"], want["params"], "bf16 params")
        _same(got["bf16"]["buffers"], want["buffers"], "bf16 buffers")  # rotary frequencies stay fp32
        assert torch.equal(got["bf16"]["logits"], want["logits"])


@pytest.mark.slow  # the worlds of 3 (and 2) processes these tests share take most of a minute
def test_each_rank_reads_and_holds_a_third(three):
    for r, got in enumerate(three):
        wide = got["wide"]
        assert 0.3 < wide["read"] / wide["total"] < 0.36, (r, wide)
        # host high-water mark of the load: a third of the weights in fp32 plus their mapped bf16
        # pages and one tensor's staging copy, against `from_pretrained` of the whole model in the
        # same process (measured ~0.45 here)
        assert wide["sharded_peak"] < 0.6 * wide["full_peak"], (r, wide)


@pytest.mark.slow  # the worlds of 3 (and 2) processes these tests share take most of a minute
def test_critic_head_is_the_same_at_any_rank_count(ckpts, two, three):
    want = expected(ckpts[1]["qwen2-untied"])["params"]
    head0 = {n: t for n, t in two[0]["critic"]["params"].items() if n.startswith("score.")}
    assert head0.keys() == {"score.weight", "score.bias"}
    for got in two + three:
        params = got["critic"]["params"]
        _same({n: params[n] for n in head0}, head0, "critic head")
        backbone = {n: t for n, t in params.items() if not n.startswith("score.")}
        _same(backbone, {n: want[n] for n in backbone}, "critic backbone")
    # transformers' init of a new head: normal with std initializer_range (0.02), zero bias
    assert 0.01 < head0["score.weight"].std() < 0.03 and not head0["score.bias"].any()


def test_unknown_non_persistent_buffer_is_refused(ckpts):
    from molt_hpc.models.sharded import meta_model, rebuild_buffers

    model = meta_model(ckpts[1]["qwen2-tied"], critic=False, dtype=torch.float32, attn="sdpa")
    model.model.register_buffer("scale", torch.ones(3, device="meta"), persistent=False)
    model.to_empty(device="cpu")
    with pytest.raises(ValueError, match=r"buffer model\.scale is not in the checkpoint"):
        rebuild_buffers(model)


def test_renamed_and_fused_experts_of_mixtral_in_one_process(tmp_path):
    """Mixtral's checkpoints also rename (`block_sparse_moe` → `mlp`) and call projections w1/w3/w2;
    unsharded (plain tensors, no process group), every tensor still equals `from_pretrained`."""
    from transformers import AutoModelForCausalLM, MixtralConfig

    from molt_hpc.checkpoint import model_shapes
    from molt_hpc.models.sharded import load_local_shards, meta_model, rebuild_buffers

    config = MixtralConfig(vocab_size=100, hidden_size=32, intermediate_size=16, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=3)  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    assert "model.layers.0.block_sparse_moe.experts.2.w3.weight" in model_shapes(tmp_path)
    model = meta_model(tmp_path, critic=False, dtype=torch.float32, attn="sdpa")
    model.to_empty(device="cpu")
    rebuild_buffers(model)
    stats = load_local_shards(model, tmp_path)
    assert stats.bytes_read == stats.bytes_total > 0
    want = expected(tmp_path)
    _same(dict(model.named_parameters()), want["params"], "mixtral params")
    _same(dict(model.named_buffers()), want["buffers"], "mixtral buffers")
    with torch.no_grad():
        logits = model(input_ids=IDS, position_ids=POS, use_cache=False).logits
    assert torch.allclose(logits, want["logits"], atol=1e-5, rtol=0)
