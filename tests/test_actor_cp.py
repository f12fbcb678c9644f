"""Sequence packing and Ulysses context parallelism in the trainer, against a plain model on padded rows.

Real parts: a transformers Qwen3 built from a config (random weights, fp32), `molt_hpc.actor`'s own
micro-batching, attention function, FSDP2 (`parallelize`) with activation checkpointing, and real
2-process gloo groups (`torch.multiprocessing.spawn`). The expected values are a plain single-process
model's log-probs and gradients on one sample per padded row, where transformers' own SDPA runs.
"""

import copy
import dataclasses
import os
import random

import pytest
import torch
import torch.distributed as dist

from molt_hpc.actor.packing import packed, padded, rank_micro_batches
from molt_hpc.algorithm import compute_advantages, experience_from_groups, policy_loss, token_logprobs
from molt_hpc.algorithm.loss import LossScale
from molt_hpc.config import load_config
from molt_hpc.parallel.attention import DocumentAttention, use_document_attention
from molt_hpc.trajectory import Group, Trajectory
from tests.ranks import spawn_ranks

V = 61
CPU = torch.device("cpu")


def tiny_model(kv_heads: int = 1):
    """4 query heads over `kv_heads` KV heads: with cp = 2 and one KV head, the KV head is repeated."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=8, pad_token_id=0,
                         tie_word_embeddings=False)  # fmt: skip
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa").train()


def groups(n_groups: int = 3, size: int = 3, seed: int = 0) -> list[Group]:
    """Multi-turn samples of 5..27 tokens with noisy rollout log-probs and distinct rewards."""
    rng = random.Random(seed)
    out = []
    for g in range(n_groups):
        samples = []
        for s in range(size):
            tokens = [rng.randrange(1, V) for _ in range(rng.randint(2, 6))]
            ranges = []
            for turn in range(rng.randint(1, 3)):
                if turn:
                    tokens += [rng.randrange(1, V) for _ in range(rng.randint(1, 3))]
                start = len(tokens)
                tokens += [rng.randrange(1, V) for _ in range(rng.randint(1, 7))]
                ranges.append((start, len(tokens)))
            n = sum(e - b for b, e in ranges)
            lps = [-rng.uniform(2.0, 6.0) for _ in range(n)]
            samples.append(Trajectory(tokens, ranges[0][0], ranges, lps, [0] * n, rng.random(), group_id=f"g{g}",
                                      rollout_id=f"g{g}s{s}"))  # fmt: skip
        out.append(Group(f"g{g}", f"p{g}", samples))
    return out


def config(*sets: str):
    base = ["actor.device='cpu'", "rollout.max_total_tokens=64", "data.max_prompt_tokens=16", "actor.grad_clip=1e9"]
    return load_config(None, [*base, *sets])


def reference_logprobs(model, exp, temperature: float):
    logits = model(input_ids=exp.sequences, position_ids=exp.position_ids, use_cache=False).logits
    return token_logprobs(logits, exp.sequences, temperature=temperature, chunk=7, mask=exp.action_mask)


def test_packed_logprobs_equal_padded_ones() -> None:
    """Several samples per row, position ids restarting, attention confined to each: the same log-probs,
    entropies and GSPO loss (fp32, 1e-6) as one sample per padded row."""
    cfg = config("algorithm.policy_loss='gspo'", "algorithm.is_level='sequence'", "algorithm.is_correction='mask'")
    exp = compute_advantages(experience_from_groups(groups(), max_len=64, pad_id=0), cfg.algorithm)
    plain = tiny_model()
    model = copy.deepcopy(plain)
    use_document_attention(model, DocumentAttention("sdpa", CPU))
    from molt_hpc.actor.batch import policy_logprobs

    want_lp, want_ent = reference_logprobs(plain, exp, 0.7)
    rows = torch.arange(exp.sequences.shape[0])
    bins = [rows[:4], rows[4:5], rows[5:]]  # 4 samples in one row, one alone, the rest together
    got_lp, got_ent = torch.zeros_like(want_lp), torch.zeros_like(want_ent)
    for part in bins:
        mb = packed(exp, part)
        assert mb.batch.sequences.shape[0] == 1 and len(set(mb.batch.seq_index[0].tolist())) == len(part)
        lp, ent = policy_logprobs(model, mb.batch, 0.7, chunk=5)
        mb.put(got_lp, lp)
        mb.put(got_ent, ent)
        if len(part) == 4:  # the same samples one per padded row, through document attention (plain causal)
            alone = policy_logprobs(model, padded(exp, part).batch, 0.7, chunk=5)[0]
            assert torch.allclose(alone, want_lp[part][:, : alone.shape[1]], atol=1e-6, rtol=0)
    mask = exp.action_mask
    assert torch.allclose(got_lp[mask], want_lp[mask], atol=1e-6, rtol=0), (got_lp - want_lp).abs().max()
    assert torch.allclose(got_ent[mask], want_ent[mask], atol=1e-6, rtol=0)
    assert (got_lp[~mask] == 0).all()
    # the sequence-level loss over the packed layout: the same value
    count = LossScale(int(mask.sum()), len(torch.unique(exp.seq_index[mask])))  # GSPO: the mean over samples
    want, _ = policy_loss(want_lp, exp.action_log_probs, exp.advantages, mask, cfg.algorithm, count,
                          seq_index=exp.seq_index, n_samples=exp.num_samples)  # fmt: skip
    mb = packed(exp, rows)
    lp, _ = policy_logprobs(model, mb.batch, 0.7, chunk=5)
    got, _ = policy_loss(lp, mb.batch.action_log_probs, mb.batch.advantages, mb.batch.action_mask, cfg.algorithm,
                         count, seq_index=mb.batch.seq_index, n_samples=exp.num_samples)  # fmt: skip
    assert abs(float(got.detach()) - float(want.detach())) < 1e-6 and abs(float(want.detach())) > 1e-4


def test_packed_critic_values_equal_padded_ones() -> None:
    """The critic (a token-classification head) reads packed rows the same way: values at the own index."""
    from transformers import AutoModelForTokenClassification

    from molt_hpc.actor.batch import critic_values
    from molt_hpc.actor.build import disable_dropout

    config = tiny_model().config
    config.num_labels = 1
    torch.manual_seed(1)
    plain = AutoModelForTokenClassification.from_config(config, attn_implementation="sdpa")
    disable_dropout(plain)  # as the trainer loads it
    exp = experience_from_groups(groups(), max_len=64, pad_id=0)
    want = critic_values(plain, exp)
    critic = copy.deepcopy(plain)
    use_document_attention(critic, DocumentAttention("sdpa", CPU))
    mb = packed(exp, torch.arange(exp.sequences.shape[0]))
    got = torch.zeros_like(want)
    mb.put(got, critic_values(critic, mb.batch))
    mask = exp.action_mask
    assert torch.allclose(got[mask], want[mask], atol=1e-6, rtol=0) and want[mask].abs().max() > 1e-3


def test_a_leaked_attention_would_be_seen() -> None:
    """The check above can fail: the same packed row with one document per row (no mask) differs."""
    exp = experience_from_groups(groups(), max_len=64, pad_id=0)
    plain = tiny_model()
    want, _ = reference_logprobs(plain, exp, 1.0)
    mb = packed(exp, torch.arange(exp.sequences.shape[0]))
    leaky = plain(input_ids=mb.batch.sequences, position_ids=torch.arange(mb.batch.sequences.shape[1])[None],
                  use_cache=False).logits  # fmt: skip
    lp, _ = token_logprobs(leaky, mb.batch.sequences, mask=mb.batch.action_mask)
    got = torch.zeros_like(want)
    mb.put(got, lp)
    assert (got - want)[exp.action_mask].abs().max() > 1e-3


def test_micro_batch_take_lays_out_any_per_token_tensor() -> None:
    """`take` moves a [B, T, layers, top_k] tensor (replayed MoE routing) exactly like the tokens."""
    exp = experience_from_groups(groups(), max_len=64, pad_id=0)
    b, t = exp.sequences.shape
    routed = torch.arange(b * t * 2 * 3).reshape(b, t, 2, 3)
    code = exp.sequences * 1000 + torch.arange(t)  # a token's id and column, to follow it
    mb = packed(exp, torch.tensor([2, 0, 5]))
    got = mb.take(routed, -1)
    assert got.shape == (1, mb.batch.sequences.shape[1], 2, 3)
    assert torch.equal(mb.take(code), (mb.batch.sequences * 1000 + mb.src_col))
    assert torch.equal(got, routed[mb.src_row, mb.src_col])


# ---- two gloo ranks -----------------------------------------------------------------------------

CASES = {
    # CP = 2 over packed rows, GSPO's sequence ratio, a KL term (the reference model runs under CP too)
    "cp2 packed gspo": ("actor.cp=2", "actor.packing='on'", "actor.max_tokens_per_micro_batch=64",
                        "algorithm.policy_loss='gspo'", "algorithm.is_level='sequence'", "algorithm.kl_coef=0.1"),
    # CP = 2 over padded rows (odd lengths: padded to a multiple of 2), PPO with entropy
    "cp2 padded ppo": ("actor.cp=2", "actor.packing='off'", "actor.micro_batch_size=2",
                       "algorithm.entropy_coef=0.01"),
    # two data-parallel ranks packing: bins dealt to ranks, the global token mean over both
    "dp2 packed ppo": ("actor.packing='on'", "actor.max_tokens_per_micro_batch=64"),
    # the step recomputes the old policy's log-probs (one no-grad forward) for a truncated IS factor
    "dp2 packed ppo truncated IS": ("actor.packing='on'", "actor.max_tokens_per_micro_batch=64",
                                    "algorithm.is_correction='truncate'", "algorithm.is_threshold=1.05"),
}  # fmt: skip


def reference_update(cfg, plain, ref_model, exp):
    """-gradient of the step's loss on one process, padded rows (what SGD with lr 1 moves)."""
    if ref_model is not None:
        with torch.no_grad():
            exp.base_log_probs = reference_logprobs(ref_model, exp, cfg.rollout.temperature)[0]
    exp = compute_advantages(exp, cfg.algorithm)
    lp, ent = reference_logprobs(plain, exp, cfg.rollout.temperature)
    mask = exp.action_mask  # every token and sample of the batch, on this one process
    count = LossScale(int(mask.sum()), len(torch.unique(exp.seq_index[mask])))
    old = lp.detach() if cfg.algorithm.recompute_old(cfg.actor.ppo_epochs) else None  # the weights before the step
    loss, _ = policy_loss(lp, exp.action_log_probs, exp.advantages, exp.action_mask, cfg.algorithm, count,
                          seq_index=exp.seq_index, n_samples=exp.num_samples, base_log_probs=exp.base_log_probs,
                          entropy=ent, old_log_probs=old)  # fmt: skip
    loss.backward()
    return {n: -p.grad for n, p in plain.named_parameters()}, lp.detach(), exp.base_log_probs, float(loss.detach())


def _rank_main(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))  # fmt: skip
    from molt_hpc.actor import build
    from molt_hpc.actor.batch import policy_logprobs
    from molt_hpc.actor.packing import sequence_layout
    from molt_hpc.actor.state import Trainable
    from molt_hpc.actor.step import Meter, Models, build_experience, update_policy
    from molt_hpc.actor.world import init_world
    from molt_hpc.config.train import ActorConfig
    from molt_hpc.parallel import parallelize

    world_cp = init_world(ActorConfig(device="cpu", cp=2))  # a (dp 1, cp 2) grid
    world_dp = dataclasses.replace(world_cp, grid=None)  # the same two ranks as data-parallel ranks
    results = {}
    for name, sets in CASES.items():
        cfg = config(*sets, "actor.activation_checkpointing=true", "rollout.temperature=0.7")
        world = world_cp if cfg.actor.cp == 2 else world_dp
        plain, step_groups = tiny_model(), groups()
        ref_plain = copy.deepcopy(plain).eval().requires_grad_(False) if cfg.algorithm.kl_coef else None
        model, ref = copy.deepcopy(plain), copy.deepcopy(ref_plain)
        before = {n: p.detach().clone() for n, p in plain.named_parameters()}
        docs, pack_tokens = sequence_layout(cfg, world, model)
        parallelize(model, world.mesh, cfg.actor, documents=docs)
        if ref is not None:
            parallelize(ref, world.mesh, cfg.actor, documents=docs)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        models = Models(Trainable("policy", model, opt, build.build_scheduler(opt, cfg.actor, 10)), reference=ref,
                        pack_tokens=pack_tokens)  # fmt: skip
        exp = build_experience(step_groups, cfg, models, world, pad_id=0)
        lp = None
        if world.cp is not None:  # the whole batch as one padded micro-batch, gathered over the CP group
            with torch.no_grad():
                whole = rank_micro_batches(exp, torch.arange(exp.sequences.shape[0]), 99, None, world)[0]
                lp = policy_logprobs(model, whole.batch, 0.7, 7)[0]
        meter = Meter()
        update_policy(exp, cfg, models, world, meter)
        moved = {n: p.full_tensor() - before[n] for n, p in model.named_parameters()}
        want, want_lp, want_base, want_loss = reference_update(
            cfg, plain, ref_plain, experience_from_groups(step_groups, max_len=64)
        )
        results[name] = {
            "moved": moved, "want": want, "lp": lp, "want_lp": want_lp, "base": exp.base_log_probs,
            "want_base": want_base, "mask": exp.action_mask, "loss": meter.reduce()["loss"], "want_loss": want_loss,
            "docs": docs, "old": exp.old_log_probs,
        }  # fmt: skip
    dist.destroy_process_group()
    if rank == 0:
        torch.save({k: {f: v for f, v in r.items() if f != "docs"} | {"docs": r["docs"] is not None}
                    for k, r in results.items()}, out)  # fmt: skip


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    from molt_hpc.net import free_port

    out = tmp_path_factory.mktemp("cp") / "ranks.pt"
    spawn_ranks(_rank_main, (free_port("127.0.0.1"), str(out)), 2)
    return torch.load(out, weights_only=False)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_move_the_weights_as_one_plain_process(two_ranks, case) -> None:
    """CP = 2 (and DP = 2 packed) under FSDP2 + activation checkpointing: the same gradient as a plain
    model's on padded rows (SGD with lr 1 moves each weight by -grad), to 1e-6."""
    r = two_ranks[case]
    assert r["docs"]
    for n, want in r["want"].items():
        assert want.abs().max() > 1e-5 or "norm" in n, n  # a real gradient
        assert torch.allclose(r["moved"][n], want, atol=1e-6, rtol=0), (case, n, (r["moved"][n] - want).abs().max())
    mask = r["mask"]
    if r["lp"] is not None:  # CP: the gathered log-probs of the whole batch equal the plain ones
        assert torch.allclose(r["lp"][mask], r["want_lp"][mask], atol=1e-6, rtol=0)
    if r["want_base"] is not None:  # the reference model's log-probs, through rows_forward under CP
        assert torch.allclose(r["base"][mask], r["want_base"][mask], atol=1e-6, rtol=0)
    assert abs(r["loss"] - r["want_loss"]) < 1e-6  # the reported loss: counted once per CP group
    if "IS" in case:  # the recomputed old policy: the weights' log-probs before the update
        assert torch.allclose(r["old"][mask], r["want_lp"][mask], atol=1e-6, rtol=0)
    else:
        assert r["old"] is None  # no extra forward unless the config asks for it


# ---- the hook, the checks and the config errors ---------------------------------------------------


def test_cp_slices_any_per_token_tensor_like_the_tokens() -> None:
    """`RowSlice.local` (the hook replayed MoE routing plugs into) pads a row to a multiple of cp and
    gives each rank the same columns of every per-token tensor as of the ids."""
    from molt_hpc.parallel.attention import AttentionSetup
    from molt_hpc.parallel.context import ContextParallel

    exp = experience_from_groups(groups(), max_len=64, pad_id=0)
    mb = packed(exp, torch.tensor([0, 1, 2])).batch
    t = mb.sequences.shape[1]
    assert t % 3, "the row needs padding for cp = 3"
    routed = torch.randint(0, 8, (1, t, 2, 2))
    code = mb.sequences * 1000 + torch.arange(t)
    parts = []
    for rank in range(3):
        rows = AttentionSetup("sdpa", ContextParallel(group=None, rank=rank, size=3)).rows(mb)
        ids, lo = rows.inputs["input_ids"], rank * (-(-t // 3))
        assert ids.shape[1] == -(-t // 3)
        assert torch.equal(rows.local(code, -1)[ids >= 0][: max(0, t - lo)] // 1000, ids[0, : max(0, t - lo)])
        parts.append(rows.local(routed, -1))
    whole = torch.cat(parts, dim=1)
    assert torch.equal(whole[:, :t], routed) and (whole[:, t:] == -1).all()
    assert rows.layout.packed  # three samples in the row
    assert rows.layout.cu_seqlens[-1] == whole.shape[1] and rows.layout.max_len == max(mb.position_ids[0]) + 1


@pytest.mark.parametrize(("heads", "kv", "cp", "repeats"), [(4, 2, 2, 1), (4, 1, 2, 2), (8, 2, 4, 2), (6, 3, 2, 2),
                                                            (4, 4, 4, 1), (12, 3, 4, 4)])  # fmt: skip
def test_kv_heads_are_repeated_only_as_needed(heads, kv, cp, repeats) -> None:
    from molt_hpc.parallel.context import kv_repeats

    assert kv_repeats(heads, kv, cp) == repeats
    assert (kv * repeats) % cp == 0 and heads % (kv * repeats) == 0


def test_what_cp_and_packing_cannot_run_is_refused_with_the_fix() -> None:
    from transformers import MambaConfig, MambaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from molt_hpc.actor.packing import packing_on
    from molt_hpc.actor.world import actor_meshes
    from molt_hpc.config.train import ActorConfig
    from molt_hpc.parallel.attention import check_model
    from molt_hpc.parallel.context import kv_repeats

    with pytest.raises(ValueError, match="does not divide the model's 6 attention heads"):
        kv_repeats(6, 2, 4)
    with pytest.raises(ValueError, match="'sdpa' or 'flash_attention_2', not 'eager'"):
        check_model(tiny_model(), "eager", 2)
    mamba = MambaForCausalLM(MambaConfig(vocab_size=V, hidden_size=16, state_size=4, num_hidden_layers=1))
    with pytest.raises(ValueError, match=r"full softmax attention \(linear_attention\).*actor.packing = 'off'"):
        check_model(mamba, "sdpa", 1)
    sliding = Qwen2ForCausalLM(Qwen2Config(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                           num_attention_heads=2, num_key_value_heads=1, use_sliding_window=True,
                                           sliding_window=8, max_window_layers=0))  # fmt: skip
    with pytest.raises(ValueError, match="sliding_attention"):
        check_model(sliding, "sdpa", 2)
    with pytest.raises(ValueError, match="cp = 2 does not divide the actor pool's 3 ranks"):
        actor_meshes("cpu", 3, 2)
    assert packing_on(ActorConfig(), "sdpa", tiny_model())  # auto: packed
    assert not packing_on(ActorConfig(), "sdpa", mamba)  # auto: what cannot be packed is padded
    assert not packing_on(ActorConfig(), "eager", tiny_model())
    assert not packing_on(ActorConfig(packing="off"), "sdpa", tiny_model())
    with pytest.raises(ValueError, match="Mamba"):
        packing_on(ActorConfig(packing="on"), "sdpa", mamba)


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["actor.cp=2", "model.attn_implementation='eager'"], "actor.cp = 2 needs model.attn_implementation"),
        (["actor.packing='on'", "model.attn_implementation='eager'"], "actor.packing = 'on' needs"),
        (["actor.max_tokens_per_micro_batch=100"], r"max_tokens_per_micro_batch \(100\) is below"),
        (["actor.cp=3"], r"actor.cp = 3 does not divide model.tiny.num_heads \(4\)"),
    ],
)
def test_config_errors_name_the_fix(sets, message) -> None:
    from molt_hpc.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        load_config(None, sets)


def test_a_local_run_refuses_ranks_that_cp_does_not_divide(tmp_path) -> None:
    from tests.conftest import molt

    res = molt("run", "--set", f'run.root="{tmp_path}"', "--set", "actor.cp=2", "--set", "actor.ranks=3")
    assert res.returncode == 2 and "actor.ranks (3) is not a multiple of actor.cp (2)" in res.stderr
    assert not any(tmp_path.iterdir())  # refused before a run directory was made
