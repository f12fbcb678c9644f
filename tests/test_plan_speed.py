"""The plan's speed prediction: each formula against numbers worked out here from its definition, the
calibration on the CPU, `plan --balance` on a shipped multi-node config, and `status` setting the
prediction beside a finished run's measured step split."""

import math
import re
from pathlib import Path

import pytest

from molt_hpc.config import load_config, to_toml
from molt_hpc.log import MetricsWriter
from molt_hpc.plan.arch import Arch, Block
from molt_hpc.plan.speed import decode_step, predict
from molt_hpc.plan.verdict import make_plan
from molt_hpc.rundir import create_run_dir
from tests.conftest import molt

V, H, L, HEADS, KV, D = 1000, 256, 4, 4, 2, 64
BLOCK = 3 * H * 1024 + H * (H + 2 * KV * D) + H * H + 2 * H  # MLP, q/k/v, o, two norms
ROOT = 2 * V * H + H  # untied embedding and head, final norm

ROUND = [  # a CPU profile of round numbers
    "plan.cpu.memory_gb_per_s=10", "plan.cpu.decode_efficiency=0.5", "plan.cpu.matmul_tflops=0.1",
    "plan.cpu.mfu_small=0.25", "plan.cpu.builtin_step_ms=2", "plan.cpu.builtin_row_ms=0.01",
    "plan.cpu.builtin_prefill_layer_ms=1.5",
    "plan.cpu.train_micro_batch_ms=10",
    "plan.cpu.refit_gb_per_s=1", "plan.cpu.refit_fixed_ms=20", "actor.device='cpu'", "engines.device='cpu'",
]  # fmt: skip


def toy_arch(tied: bool = False, experts: int = 0) -> Arch:
    per_expert = 3 * H * 64
    block = Block(BLOCK + experts * per_expert, experts=experts * per_expert) if experts else Block(BLOCK)
    root = ROOT - (V * H if tied else 0)
    return Arch("llama", V, H, L, HEADS, KV, D, 1024, tied, root, (block,) * L, experts=experts,
                top_k=2 if experts else 0, moe_intermediate=64 if experts else 0, fused_head=True)  # fmt: skip


def cfg_with(*overrides: str):
    return load_config(None, [*ROUND, *overrides])


def test_a_decode_step_is_the_slower_of_memory_and_compute_plus_its_overhead() -> None:
    p = cfg_with().plan.cpu
    # 1 GB weights + 0.5 GB KV at 10 GB/s × 0.5 = 0.3 s; 1e9 FLOP at 0.1 TFLOP/s = 0.01 s; + 2 ms
    assert decode_step(p, 1e9, 0.5e9, 1e9, 2.0) == (pytest.approx(0.302), "memory")
    # 1e12 FLOP: 10 s of compute against 0.3 s of reads
    assert decode_step(p, 1e9, 0.5e9, 1e12, 2.0) == (pytest.approx(10.002), "compute")
    assert decode_step(p, 1e3, 0.0, 1e3, 2.0)[1] == "overhead"


def test_rollout_time_of_a_hand_worked_case() -> None:
    # tiny_cpu's shape: 8 groups × 8 samples a step, 16 groups in flight, staleness 2, max_batch 64,
    # prompts of min(64, 128 - 6) = 64 tokens, 6 new tokens, fp32, one engine
    cfg = cfg_with()
    plan = make_plan(cfg, toy_arch(), local=True, gpus=0)
    s = predict(plan)
    rows = min(min(16, 3 * 8) * 8, 64)  # 128 rows wanted, the engine holds 64
    context = 64 + 6 / 2
    weights = 4 * (L * BLOCK + H + V * H)  # blocks, final norm, LM head (the embedding is a lookup)
    kv = rows * context * L * 2 * KV * D * 4
    mm = L * BLOCK + H + V * H
    flops = rows * (2 * mm + 4 * L * HEADS * D * context)
    step = max((weights + kv) / (10e9 * 0.5), flops / 0.1e12) + 0.002 + rows * 0.01e-3  # fixed + per row
    assert s.rollout.rows == rows and s.rollout.groups == 16
    assert s.rollout.decode_step_s == pytest.approx(step, rel=1e-9)
    assert s.rollout.decode_s == pytest.approx(64 / rows * 6 * step, rel=1e-9)  # 64 samples, 6 tokens each
    prefill = 64 * 64 * (2 * mm + 4 * L * HEADS * D * 32) / (0.1e12 * 0.25)
    prefill += 64 / rows * 1 * L * 1.5e-3  # one prefill call per round (6 tokens < prefill_interval 8), 1.5 ms a layer
    assert s.rollout.prefill_s == pytest.approx(prefill, rel=1e-9)
    assert s.rollout_tokens_per_s == pytest.approx(64 * 6 / (64 / rows * 6 * step + prefill), rel=1e-9)
    often = predict(make_plan(cfg_with("engines.prefill_interval=2"), toy_arch(), local=True, gpus=0))
    # a prefill every 2 decode steps of 6-token answers: 3 calls a round instead of 1
    assert often.rollout.prefill_s - s.rollout.prefill_s == pytest.approx(64 / rows * 2 * L * 1.5e-3, rel=1e-9)
    half = predict(plan, accepted=0.5)  # dynamic sampling keeps half the groups: twice the rollout, same training
    assert half.rollout.seconds == pytest.approx(2 * s.rollout.seconds, rel=1e-9)
    assert half.train.flops == s.train.flops
    # staleness 0: the bound is 8 groups in flight under `bound`, 8 over the half kept = 16 under `kept_share`
    # (neither 32 groups in flight nor 1024 rows an engine caps them); a request decodes 6 of the 6 + 8 / 2
    # steps it is in flight (it waits half a prefill interval for its prefill call)
    narrow = ["buffer.max_staleness=0", "rollout.groups_in_flight=32", "engines.max_batch=1024"]
    for admission, groups in (("bound", 8), ("kept_share", 16)):
        kept = make_plan(cfg_with(*narrow, f"rollout.admission={admission}"), toy_arch(), local=True, gpus=0)
        assert predict(kept, accepted=0.5).rollout.rows == math.ceil(groups * 8 * 6 / (6 + 4)), admission
        # a group's longest answer of 16 tokens holds its admission for 16 + 4 steps, its rows decode 6 of them
        assert predict(kept, accepted=0.5, tail=16).rollout.rows == math.ceil(groups * 8 * 6 / (16 + 4)), admission


def test_train_time_counts_recompute_the_reference_and_the_head() -> None:
    base = cfg_with("actor.activation_checkpointing=false")
    ac_ref = cfg_with("actor.activation_checkpointing=true", "algorithm.kl_coef=0.1")
    samples, tokens, generated = 64, 64 * 70, 64 * 6
    body = 2 * (L * BLOCK + H) + 4 * L * HEADS * D * 35  # per token forward: blocks, final norm, attention
    head = 2 * V * H  # per action position forward
    plain = 3 * body * tokens + 4 * head * generated  # fwd + bwd; head fwd, recompute, two gradients
    with_both = 4 * body * tokens + 4 * head * generated + body * tokens + head * generated
    for cfg, want in ((base, plain), (ac_ref, with_both)):
        plan = make_plan(cfg, toy_arch(), local=True, gpus=0)
        t = predict(plan).train
        assert samples == cfg.actor.groups_per_step * cfg.rollout.n_samples
        assert t.flops == pytest.approx(want, rel=1e-9)
        assert t.compute_s == pytest.approx(want / (0.1e12 * 0.25), rel=1e-9)


def test_step_bound_overlaps_only_an_async_run_on_separate_devices() -> None:
    arch = toy_arch()
    sync = predict(make_plan(cfg_with("buffer.max_staleness=0"), arch, local=True, gpus=0))
    assert not sync.overlap
    assert sync.step_s == pytest.approx(sync.rollout.seconds + sync.train.seconds + sync.refit_s)
    gpus = ["actor.device='cuda'", "engines.device='cuda'", "buffer.max_staleness=1"]
    split = predict(make_plan(cfg_with(*gpus), arch, local=True, gpus=2))
    assert split.overlap
    assert split.step_s == pytest.approx(max(split.rollout.seconds, split.train.seconds) + split.refit_s)
    shared = predict(make_plan(cfg_with(*gpus), arch, local=True, gpus=1))  # one GPU for both pools
    assert not shared.overlap


def test_a_shared_device_prices_the_engine_and_the_trainer_beside_each_other() -> None:
    from molt_hpc.plan.speed import shared_device

    assert shared_device(1.0, 0.5, 0.0, 2.0) == (1.5, 0.5)  # rate 0: in sequence, the slowdown unused
    assert shared_device(1.0, 0.5, 1.0, 1.0) == (1.0, 0.5)  # full speed both: the overlap of two devices
    assert shared_device(0.2, 0.5, 1.0, 1.0) == (0.5, 0.5)
    # the engine bounds: the training takes 1.2 x 0.5 = 0.6 s, beside it the engine does 0.25 x 0.6 = 0.15 s
    # of its 1 s, the other 0.85 s alone after it
    assert shared_device(1.0, 0.5, 0.25, 1.2) == pytest.approx((0.6 + 0.85, 0.6))
    # the trainer bounds: the engine's 0.1 s take 0.1 / 0.5 = 0.2 s beside the training, which does 0.2 / 1.5
    # of its 1 s meanwhile and the rest alone
    step = 0.2 + (1.0 - 0.2 / 1.5)
    assert shared_device(0.1, 1.0, 0.5, 1.5) == pytest.approx((step, step))


def test_an_async_run_on_one_device_is_priced_with_the_measured_sharing() -> None:
    arch = toy_arch()
    sets = ["plan.cpu.shared_decode_rate=0.4", "plan.cpu.shared_train_slowdown=1.25"]
    s = predict(make_plan(cfg_with(*sets), arch, local=True, gpus=0))  # both pools on the CPU, staleness 2
    assert not s.overlap and s.shared == (0.4, 1.25)
    r, t = s.rollout.seconds, s.train.seconds
    beside = 1.25 * t
    if r >= 0.4 * beside:
        step, train = r + beside * 0.6, beside
    else:
        step = t + r / 0.4 * (1 - 1 / 1.25)
        train = step
    assert s.step_s == pytest.approx(step + s.refit_s, rel=1e-9)
    assert s.train_wall_s == pytest.approx(train, rel=1e-9)
    assert s.wait_s == pytest.approx(step - train, rel=1e-9, abs=1e-12)
    sync = predict(make_plan(cfg_with(*sets, "buffer.max_staleness=0"), arch, local=True, gpus=0))
    assert sync.shared is None  # nothing decodes beside a synchronous step's training
    assert sync.step_s == pytest.approx(sync.rollout.seconds + sync.train.seconds + sync.refit_s)
    gpu = ["actor.device='cuda'", "engines.device='cuda'", "plan.cuda.shared_decode_rate=0.3"]
    shared_gpu = predict(make_plan(cfg_with(*gpu), arch, local=True, gpus=1))  # one GPU: the GPU's profile
    assert shared_gpu.shared == (0.3, load_config(None).plan.cuda.shared_train_slowdown)
    assert predict(make_plan(cfg_with(*gpu), arch, local=True, gpus=2)).shared is None  # a GPU each


def test_refit_is_bytes_over_the_link_plus_buckets_and_its_fixed_cost() -> None:
    cfg = cfg_with("refit.bucket_mb=1")
    arch = toy_arch()
    wire = 4 * arch.params  # fp32, one rank: no gather
    buckets = -(-wire // (1 << 20))
    s = predict(make_plan(cfg, arch, local=True, gpus=0))
    assert s.refit_s == pytest.approx(wire / 1e9 + buckets * 0.002 + 0.020, rel=1e-9)


def test_engines_on_a_one_rank_trainers_gpu_read_its_parameters_in_place() -> None:
    """One GPU, a trainer of one rank, built-in engines: no buckets, no link; the engine reads the fp32 master
    weights and writes its own dtype, a copy at memory bandwidth, plus the fixed cost. vLLM engines on the
    same GPU take buckets through shared slots and their own fixed cost."""
    arch = toy_arch()
    gpu = ["actor.device='cuda'", "engines.device='cuda'", "plan.cuda.memory_gb_per_s=100",
           "plan.cuda.refit_fixed_ms=10", "plan.cuda.vllm_refit_fixed_ms=90", "plan.cuda.refit_gb_per_s=50",
           "refit.bucket_mb=1", "model.dtype='bfloat16'"]  # fmt: skip
    one = make_plan(cfg_with(*gpu), arch, local=True, gpus=1)
    wire = 2 * arch.params  # bf16 on the wire, fp32 master weights read
    assert (one.refit.buckets, one.refit.send_s) == (0, 0.0)
    assert predict(one).refit_s == pytest.approx((4 * arch.params + wire) / 100e9 + 0.010, rel=1e-9)
    two = make_plan(cfg_with(*gpu), arch, local=True, gpus=2)  # a GPU each: buckets over the node's link
    buckets = -(-wire // (1 << 20))
    assert predict(two).refit_s == pytest.approx(wire / 50e9 + buckets * 0.002 + 0.010, rel=1e-9)
    vllm = make_plan(cfg_with(*gpu, "engines.kind='vllm'"), arch, local=True, gpus=1)
    assert predict(vllm).refit_s == pytest.approx(wire / 50e9 + buckets * 0.002 + 0.090, rel=1e-9)


def test_a_moe_decode_reads_the_experts_its_rows_touch() -> None:
    arch = toy_arch(experts=8)  # top-2 of 8: one row touches 1/4 of them, many rows nearly all
    one = predict(make_plan(cfg_with("engines.max_batch=1"), arch, local=True, gpus=0))
    assert one.rollout.rows == 1
    expert_bytes = 4 * arch.expert_params
    dense = 4 * (arch.params - arch.expert_params - V * H)
    kv = 1 * (64 + 0.5 * 6) * L * 2 * KV * D * 4
    memory = (dense + expert_bytes * (1 - (1 - 2 / 8) ** 1) + kv) / (10e9 * 0.5)
    mm = arch.params - arch.expert_params + arch.expert_params * 2 / 8 - V * H
    compute = (2 * mm + 4 * L * HEADS * D * 67) / 0.1e12
    assert one.rollout.decode_step_s == pytest.approx(max(memory, compute) + 0.002 + 0.01e-3, rel=1e-9)  # one row


def test_the_plan_report_ends_with_the_speed_block() -> None:
    from molt_hpc.plan import plan_config, report

    cfg = load_config("configs/8b_dense.toml")
    plan, suggestions = plan_config(cfg, local=False)
    text = report(plan, suggestions)
    s = predict(plan)
    block = text[text.index("speed per step") : text.index("verdict:")]
    assert f"{s.trained_tokens_per_s:,.0f} trained tokens/s" in block and f"bound by {s.bound}" in block
    assert "256 samples of 512 prompt + 2,048 response tokens" in block  # 32 groups × 8, full length


def test_calibration_measures_this_cpu_and_its_output_is_a_config() -> None:
    out = molt("plan", "configs/tiny_cpu.toml", "--calibrate", env={"CUDA_VISIBLE_DEVICES": ""}, timeout=300)
    assert out.returncode == 0, out.stderr
    values = dict(re.findall(r"^(\w+) = ([0-9.e+-]+)$", out.stdout, re.M))
    assert set(values) == {
        "memory_gb_per_s",
        "matmul_tflops",
        "builtin_step_ms",
        "builtin_row_ms",
        "builtin_prefill_layer_ms",
        "mfu_small",
        "train_micro_batch_ms",
        "train_sample_ms",
    }  # not the shared-device numbers: measured on a GPU only
    rates = ("memory_gb_per_s", "matmul_tflops", "mfu_small")
    assert all(float(values[k]) > 0 for k in rates) and float(values["mfu_small"]) <= 1, out.stdout
    # host times are what is left beside the memory and compute time: none left is a measurement too
    assert float(values["builtin_step_ms"]) >= 0 and float(values["train_micro_batch_ms"]) > 0, out.stdout
    assert float(values["builtin_row_ms"]) >= 0 and float(values["train_sample_ms"]) >= 0, out.stdout
    assert float(values["builtin_prefill_layer_ms"]) > 0, out.stdout
    sets = re.search(r"^# or: (.*)$", out.stdout, re.M).group(1).split()
    cfg = load_config("configs/tiny_cpu.toml", [s for s in sets if s != "--set"])  # the config tree takes them
    assert cfg.plan.cpu.matmul_tflops == pytest.approx(float(values["matmul_tflops"]), rel=1e-3)


def test_the_calibrated_shared_device_pair_is_printed_as_comments() -> None:
    """A GPU's calibration prints the shared-device pair commented out: the section and the `--set` line give
    the in-sequence price, which came closer to a measured run; uncommented, the pair is a config too."""
    import tomllib

    from molt_hpc.plan.calibrate import calibration_text

    values = {"memory_gb_per_s": 3000.0, "shared_decode_rate": 0.7, "shared_train_slowdown": 1.06, "mfu_small": 0.2}
    text = calibration_text(values, "cuda")
    section = tomllib.loads(text)["plan"]["cuda"]
    assert section == {"memory_gb_per_s": 3000.0, "mfu_small": 0.2}
    assert "shared" not in re.search(r"^# or: (.*)$", text, re.M).group(1)
    uncommented = tomllib.loads(re.sub(r"^# (shared_\w+ = )", r"\1", text, flags=re.M))["plan"]["cuda"]
    assert uncommented == values
    sets = [f"plan.cuda.{k}={v}" for k, v in uncommented.items()]
    assert load_config("configs/tiny_cpu.toml", sets).plan.cuda.shared_decode_rate == 0.7


def test_the_shared_device_measurement_times_both_pools_alone_and_beside_each_other() -> None:
    """`plan --calibrate`'s shared-device part on the CPU (a GPU calibration runs it there): decode steps alone
    and beside a second process that trains the config's step, and that process's steps alone and beside."""
    import torch

    from molt_hpc.plan.calibrate_shared import ALONE_STEPS, Shared, measure_shared
    from molt_hpc.plan.calibrate_train import random_model

    cfg = load_config("configs/tiny_cpu.toml", ["actor.groups_per_step=2", "data.max_prompt_tokens=16",
                                                "rollout.max_total_tokens=32", "rollout.max_new_tokens=8"])  # fmt: skip
    model, _ = random_model(cfg, torch.device("cpu"))
    s = measure_shared(cfg, model, torch.device("cpu"), lambda: None, 8, 0.3)
    assert s.decode_alone and s.decode_shared and len(s.train_alone) == ALONE_STEPS and s.train_shared
    assert 0 < s.decode_rate <= 1 and s.train_slowdown > 0
    hand = Shared([0.01, 0.03], [0.04, 0.06, 0.05], [0.2, 0.4], [0.45])
    assert hand.decode_rate == pytest.approx(0.02 / 0.05) and hand.train_slowdown == pytest.approx(0.45 / 0.3)
    faster = Shared([0.02], [0.01], [0.3], [])  # noise: faster beside; no trainer step wholly beside
    assert faster.decode_rate == 1 and faster.train_slowdown is None


@pytest.mark.parametrize(
    "sets",
    [[], ["actor.packing='off'"], ["actor.mini_batches=2", "actor.ppo_epochs=2"]],
    ids=["packed", "padded", "2x2"],
)
def test_calibration_host_steps_run_the_micro_batches_they_are_charged_for(sets: list[str]) -> None:
    """The calibration solves its two host steps' times for the speed model's parts by what each step is
    charged for; the trainer's own micro-batching of each step (a world of one) must run exactly that."""
    from molt_hpc.actor.batch import mini_batch_rows
    from molt_hpc.actor.packing import rank_micro_batches, token_budget
    from molt_hpc.actor.world import init_world
    from molt_hpc.algorithm import experience_from_groups
    from molt_hpc.config.train import ActorConfig
    from molt_hpc.plan.calibrate_train import HOST_SEQ, host_steps, synthetic_groups
    from molt_hpc.plan.shape import packs

    cfg = load_config("configs/tiny_cpu.toml", sets)
    world = init_world(ActorConfig(device="cpu"))
    act = cfg.actor
    for host in host_steps(cfg):
        groups = synthetic_groups(act.mini_batches, host.samples, HOST_SEQ, 64)
        exp = experience_from_groups(groups, max_len=HOST_SEQ, pad_id=0)
        budget = token_budget(host.cfg) if packs(host.cfg) else None
        size = host.cfg.actor.micro_batch_size
        micro = [len(rank_micro_batches(exp, r, size, budget, world)) for r in mini_batch_rows(exp, act.mini_batches)]
        assert host.micro_units == act.ppo_epochs * sum(m + 1 for m in micro)
        assert host.sample_units == act.ppo_epochs * exp.num_samples
    a, b = host_steps(cfg)
    assert a.micro_units * b.sample_units != b.micro_units * a.sample_units  # the two steps separate the parts


def test_calibration_host_parts_solve_the_two_steps() -> None:
    from molt_hpc.plan.calibrate_train import HostStep, host_parts

    a, b = HostStep(None, 4, 5, 4), HostStep(None, 16, 2, 16)
    micro, sample = 0.007, 0.0004
    assert host_parts(a, 5 * micro + 4 * sample, b, 2 * micro + 16 * sample) == pytest.approx((micro, sample))
    # noise that would make the per-sample part negative: the micro-batches alone explain both steps
    assert host_parts(a, 0.05, b, 0.01) == pytest.approx((0.06 / 7, 0.0))


def test_train_host_time_of_a_hand_worked_case() -> None:
    """Per micro-batch and update, and per sample each epoch, on each data-parallel rank."""
    cfg = cfg_with("plan.cpu.train_sample_ms=0.5", "actor.ppo_epochs=2", "actor.mini_batches=2",
                   "actor.packing='off'", "actor.micro_batch_size=8")  # fmt: skip
    t = predict(make_plan(cfg, toy_arch(), local=True, gpus=0)).train
    # 64 samples, 2 mini-batches of 32 rows, 8 a micro-batch: 4 micro-batches and an update, 4 updates a step
    assert t.overhead_s == pytest.approx((2 * 2 * (4 + 1) * 10 + 2 * 64 * 0.5) / 1e3, rel=1e-9)


def test_balance_searches_whole_node_splits_of_a_multi_node_config() -> None:
    out = molt("plan", "configs/70b_dense.toml", "--balance", timeout=300)
    assert out.returncode == 0, out.stderr
    rows = re.findall(r"trainer (\d+) GPU\(s\), engines (\d+) × (\d+) GPU\(s\).*?([\d,]+) trained tokens/s", out.stdout)
    assert len(rows) >= 3
    rates = [float(r[3].replace(",", "")) for r in rows[:3]]
    assert rates == sorted(rates, reverse=True)
    cfg = load_config("configs/70b_dense.toml")
    total = 8 * (cfg.slurm.actor.nodes + cfg.slurm.engines.nodes)
    assert all(int(t) + int(e) * int(g) == total for t, e, g, _ in rows)  # every split keeps the job's GPUs
    best = re.search(r"^  1\. (.*)$", out.stdout, re.M).group(1)
    dry = molt("submit", "configs/70b_dense.toml", "--balance", "--dry-run", timeout=300)
    assert dry.stdout.startswith("#!") and f"balance: {best}" in dry.stderr
    if "slurm.actor.nodes=" in best:  # the applied split is the rendered job's
        nodes = re.search(r"slurm\.actor\.nodes=(\d+)", best).group(1)
        assert f"#SBATCH --nodes={nodes}" in dry.stdout


def test_status_sets_the_prediction_beside_the_measured_split(tmp_path: Path) -> None:
    cfg = load_config(None, ["run.steps=6"])
    run = create_run_dir(tmp_path, "r", to_toml(cfg))
    actor, rollout = MetricsWriter(run.metrics, source="actor"), MetricsWriter(run.metrics, source="rollout")
    for step in range(1, 7):  # the first two (start-up) are left out of the means
        slow = 10.0 if step <= 2 else 1.0
        actor.write({"step": step, "wait_s": 0.1 * step * slow, "step_s": 0.4 * slow, "refit_s": 0.05, "tokens": 2400})
        rollout.write({"tokens_per_s": 300.0, "window_s": 1.0 + step % 2, "response_len_mean": 6.0,
                       "groups_accepted": 8, "in_flight_mean": 2.0 + 4 * (step % 2)})  # fmt: skip
    out = molt("status", str(run.path))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    i = lines.index("speed (predicted vs measured, per step):")
    wait = (0.3 + 0.4 + 0.5 + 0.6) / 4
    step_ms = round(1000 * (wait + 0.4 + 0.05))
    assert re.match(rf"  step +[\d.,]+ m?s vs +{step_ms} ms +\([\d.]+x\)", lines[i + 1]), lines[i + 1]
    assert re.match(r"  train +[\d.,]+ m?s vs +400 ms", lines[i + 2])
    assert re.match(rf"  rollout wait +-?[\d.,]+ m?s vs +{round(1000 * wait)} ms", lines[i + 3])
    assert re.match(r"  refit +[\d.,]+ m?s vs +50 ms", lines[i + 4])
    assert re.match(r"  rollout +[\d,]+ vs 300 tokens/s", lines[i + 5])
    # windows of 1 s at 2 groups and 2 s at 6 (two each after start-up), weighted by time; the prediction holds
    # min(groups_in_flight 16, (staleness 2 + 1) x 8 groups a step) = 16
    assert re.match(r"  in flight +16\.0 vs 4\.7 groups +\(0\.29x\)", lines[i + 6]), lines[i + 6]


def test_a_run_placed_by_its_local_launcher_is_priced_where_it_ran(tmp_path: Path) -> None:
    """A config that asks Slurm for a GPU per pool, run by `molt-hpc run` on a machine with one GPU: the pools
    shared that GPU, so the prediction beside the run has no overlap (the Slurm layout would have one)."""
    from molt_hpc.plan.speed_text import ran_where

    gpus = ["actor.device='cuda'", "engines.device='cuda'", "buffer.max_staleness=1",
            "slurm.actor.gpus_per_node=1", "slurm.engines.gpus_per_node=1"]  # fmt: skip
    cfg = load_config(None, gpus)
    run = create_run_dir(tmp_path, "r", to_toml(cfg))
    assert ran_where(cfg, run.path) == (False, None)  # no record: the config's Slurm layout
    assert predict(make_plan(cfg, toy_arch(), local=False)).overlap
    MetricsWriter(run.metrics, source="launcher").write({"event": "placement", "mode": "local", "gpus": 1})
    local, seen = ran_where(cfg, run.path)
    assert (local, seen) == (True, 1)
    shared = predict(make_plan(cfg, toy_arch(), local=local, gpus=seen))
    assert not shared.overlap
    assert shared.step_s == pytest.approx(shared.rollout.seconds + shared.train.seconds + shared.refit_s)
