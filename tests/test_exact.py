"""`engines.exact`: the engine's sampled log-probs and the trainer's log-probs are the same bits.

The engine side is the real scheduler over the real `ModelRunner` and its growing KV cache, with 1, 7
and 64 requests in flight, later requests joining mid-decode (so a token sits at many cache columns,
behind left padding of every width). The trainer side is `policy_logprobs`, the function a training
step calls, over the finished sequences: right-padded rows, packed rows under the model's own masks,
and packed rows under the trainer's document attention. With `exact` off the same comparison must
fail (the plain forwards differ in the last bits), or the test could not.
"""

import copy
import json
from concurrent.futures import Future

import pytest
import torch

from molt_hpc.actor.batch import policy_logprobs
from molt_hpc.algorithm import make_experience
from molt_hpc.engine.batch import ModelRunner, Row
from molt_hpc.engine.sampling import SamplingParams
from molt_hpc.engine.scheduler import Scheduler
from molt_hpc.engine.slots import SlotRunner
from molt_hpc.log import read_metrics
from molt_hpc.models import load_causal_lm
from molt_hpc.models.exact import make_exact
from molt_hpc.models.exact_linear import sequential_linear
from molt_hpc.parallel.attention import DocumentAttention, use_document_attention
from molt_hpc.trajectory import Trajectory
from tests.conftest import ROOT, molt

CPU = torch.device("cpu")


def _runner(model, device, slots: bool) -> ModelRunner:
    """The plain runner (growing cache), or the slot runner the engine takes on a GPU, with CUDA graphs there."""
    if not slots:
        return ModelRunner(model, device)
    return SlotRunner(model, device, max_batch=64, max_model_len=256, graphs=device.type == "cuda")


def _generate(model, n: int, temperature: float, seed: int, device=CPU, slots: bool = False, runner=None) -> list[Row]:
    """`n` requests through the scheduler (over `runner` if given): half (at least one) at once, the rest after
    three decode steps."""
    runner = runner or _runner(model, device, slots)
    sched = Scheduler(runner, eos_ids=set(), max_batch=64, max_model_len=256, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        prompt = torch.randint(4, 100, (int(torch.randint(1, 24, (1,), generator=gen)),), generator=gen).tolist()
        tokens = int(torch.randint(2, 10, (1,), generator=gen))
        rows.append(Row(prompt, SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=temperature), Future()))
    first = max(1, n // 2)
    for row in rows[:first]:
        sched.submit(row)
    for _ in range(3):
        sched._step()
    for row in rows[first:]:
        sched.submit(row)
    while sched.rows or sched.waiting:
        sched._step()
    assert all(len(r.tokens) == r.params.max_tokens for r in rows)
    return rows


def _trajectories(rows: list[Row]) -> list[Trajectory]:
    return [
        Trajectory(r.context, len(r.prompt), [(len(r.prompt), r.length)], r.logprobs, [0] * len(r.tokens), 1.0)
        for r in rows
    ]


def _trainer_sides(model, trajs: list[Trajectory], temperature: float, device=CPU) -> dict[str, tuple]:
    """(trainer log-probs, engine log-probs) of the action tokens, per layout of the trainer's rows."""
    documents = copy.deepcopy(model)
    use_document_attention(documents, DocumentAttention("sdpa", device))
    out = {}
    for name, policy, pack in (("padded", model, False), ("packed", model, True), ("documents", documents, True)):
        exp = make_experience(trajs, max_len=64, pack=pack).to(device)
        with torch.no_grad():
            logp = policy_logprobs(policy, exp, temperature, 8)[0]
        out[name] = (logp[exp.action_mask], exp.action_log_probs[exp.action_mask].to(logp.dtype))
    return out


@pytest.fixture(scope="module")
def models(tiny_model_dir):
    engine = load_causal_lm(tiny_model_dir, device="cpu")
    return engine, copy.deepcopy(engine)


@pytest.mark.parametrize("n", [1, 7, 64])
def test_exact_engine_logprobs_equal_the_trainers(models, n):
    engine, trainer = (make_exact(copy.deepcopy(m)) for m in models)
    temperature = 0.7 if n == 7 else 1.0
    rows = _generate(engine, n, temperature, seed=n)
    for name, (mine, theirs) in _trainer_sides(trainer, _trajectories(rows), temperature).items():
        assert mine.numel() == sum(len(r.tokens) for r in rows)
        assert torch.equal(mine, theirs), (name, float((mine - theirs).abs().max()))


@pytest.mark.parametrize("n", [1, 7, 64])
def test_exact_slot_runner_logprobs_equal_the_trainers(models, n):
    """The slot runner's decode steps and slot prefills (`engine.exact_slots`): what the engine runs on a GPU."""
    engine, trainer = (make_exact(copy.deepcopy(m)) for m in models)
    temperature = 0.7 if n == 7 else 1.0
    rows = _generate(engine, n, temperature, seed=n, slots=True)
    for name, (mine, theirs) in _trainer_sides(trainer, _trajectories(rows), temperature).items():
        assert mine.numel() == sum(len(r.tokens) for r in rows)
        assert torch.equal(mine, theirs), (name, float((mine - theirs).abs().max()))


def test_exact_in_bfloat16(tiny_model_dir):
    engine = make_exact(load_causal_lm(tiny_model_dir, device="cpu", dtype="bfloat16"))
    trainer = copy.deepcopy(engine)
    rows = _generate(engine, 7, 1.0, seed=3)
    for name, (mine, theirs) in _trainer_sides(trainer, _trajectories(rows), 1.0).items():
        assert torch.equal(mine, theirs), (name, float((mine - theirs).abs().max()))


def testsequential_linear_is_row_invariant():
    """The fallback where the padded multiply is not row-invariant: each row the same bits alone and among others."""
    gen = torch.Generator().manual_seed(0)
    w, b = torch.randn(96, 80, generator=gen), torch.randn(96, generator=gen)
    x = torch.randn(41, 80, generator=gen)
    alone = torch.cat([sequential_linear(x[i : i + 1], w, b) for i in range(41)])
    assert torch.equal(sequential_linear(x, w, b), alone)
    assert torch.equal(sequential_linear(x[5:], w, b), alone[5:])
    want = x.double() @ w.double().t() + b.double()
    assert torch.allclose(alone.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("aligned", [True, False], ids=["vector-code", "strided"])
def test_the_exact_activation_gives_an_element_the_same_bits_wherever_it_sits(monkeypatch, aligned):
    """Both forms of `ExactActivation`: an element alone, among others at any offset, across a call's
    boundary and in rows of any count, gets the same bits; the values are SiLU's."""
    from transformers.activations import ACT2FN

    from molt_hpc.models import exact

    monkeypatch.setattr(exact, "activation_is_invariant", lambda *_: aligned)
    act = exact.ExactActivation(ACT2FN["silu"])
    gen = torch.Generator().manual_seed(1)
    x = 4 * torch.randn(2 * exact.SPAN + 300, generator=gen)
    full = act(x)
    # short cuts at random offsets: on this project's CPU a plain SiLU gets 4 in 10 of them wrong (their tails)
    cuts = [(lo, lo + int(n)) for lo, n in zip(torch.randint(0, 2 * exact.SPAN, (100,), generator=gen).tolist(),
                                               torch.randint(1, 70, (100,), generator=gen), strict=True)]  # fmt: skip
    for lo, hi in [*cuts, (exact.SPAN - 5, exact.SPAN + 60), (17, 2 * exact.SPAN + 1)]:
        assert torch.equal(act(x[lo:hi]), full[lo:hi]), (lo, hi)
    rows = x[: 96 * 256].view(96, 256)
    assert all(torch.equal(act(rows[i : i + 1]), act(rows)[i : i + 1]) for i in (0, 37, 95))
    assert torch.allclose(full.double(), torch.nn.functional.silu(x.double()), rtol=1e-6, atol=1e-6)


def test_plain_forwards_are_not_equal(models):
    engine, trainer = (copy.deepcopy(m) for m in models)
    rows = _generate(engine, 7, 1.0, seed=7)
    for name, (mine, theirs) in _trainer_sides(trainer, _trajectories(rows), 1.0).items():
        assert torch.allclose(mine, theirs, atol=1e-4), name  # the same model, only rounding apart
        assert not torch.equal(mine, theirs), name


def test_exact_gradients_match_the_plain_model(models):
    """The exact forward's backward is plain attention's and plain linear layers': the same gradients to rounding."""
    plain, exact = copy.deepcopy(models[1]), make_exact(copy.deepcopy(models[1]))
    ids = torch.randint(4, 100, (3, 12), generator=torch.Generator().manual_seed(0))
    for m in (plain, exact):
        m.zero_grad()
        m(input_ids=ids, use_cache=False).logits.float().logsumexp(-1).sum().backward()
    for (name, a), (_, b) in zip(plain.named_parameters(), exact.named_parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-6), name


EXACT = ["--set", "engines.exact=true", "--set", "engines.device=cpu", "--set", "actor.device=cpu"]


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (["--set", "engines.kind=vllm", "--set", "actor.device=cuda"], "engines.kind = 'builtin'"),
        (["--set", "engines.device=auto"], "both to 'cpu' or both to 'cuda'"),
        (["--set", "engines.device=cuda"], "both to 'cpu' or both to 'cuda'"),
        (["--set", "rollout.top_p=0.9"], "rollout.top_p = 1"),
        (["--set", "actor.cp=2"], "actor.cp = 1"),
        (["--set", "actor.lora.rank=4"], "actor.lora.engine_weights = 'separate'"),
        (
            ["--set", "actor.lora.engine_weights=separate", "--set", "actor.lora.target_modules=['q_proj','lm_head']"],
            "drop lm_head",
        ),
    ],
)
def test_what_cannot_be_exact_is_refused(extra, words):
    result = molt("config", str(ROOT / "configs/tiny_cpu.toml"), *EXACT, *extra)
    assert result.returncode == 2, result.stderr
    assert words in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr


@pytest.mark.parametrize("n", [1, 7, 64])
def test_exact_moe_engine_logprobs_equal_the_trainers(tiny_moe_dir, n):
    """The tiny MoE (8 experts, top-2): the engine's routers and experts see other batches than the trainer's
    (one decode row, 64 rows joining mid-decode; right-padded, packed) and still give the same bits."""
    engine = make_exact(load_causal_lm(tiny_moe_dir, device="cpu"))
    trainer = copy.deepcopy(engine)
    rows = _generate(engine, n, 1.0, seed=n)
    for name, (mine, theirs) in _trainer_sides(trainer, _trajectories(rows), 1.0).items():
        assert mine.numel() == sum(len(r.tokens) for r in rows)
        assert torch.equal(mine, theirs), (name, float((mine - theirs).abs().max()))


def test_plain_moe_forwards_are_not_equal(tiny_moe_dir):
    """Without `exact` the same comparison fails on the MoE model, or the test above could not."""
    engine = load_causal_lm(tiny_moe_dir, device="cpu")
    trainer = copy.deepcopy(engine)
    rows = _generate(engine, 64, 1.0, seed=64)
    sides = _trainer_sides(trainer, _trajectories(rows), 1.0)
    assert not all(torch.equal(mine, theirs) for mine, theirs in sides.values())


def test_exact_moe_keeps_the_parameters_and_refuses_other_expert_layouts(tiny_moe_dir):
    plain = load_causal_lm(tiny_moe_dir, device="cpu")
    before = {k: v.clone() for k, v in plain.state_dict().items()}
    exact = make_exact(copy.deepcopy(plain))
    after = exact.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    experts = next(m for m in plain.modules() if hasattr(m, "gate_up_proj"))
    experts.register_parameter("extra_proj", torch.nn.Parameter(torch.zeros(2, 2, 2)))
    with pytest.raises(ValueError, match=r"engines\.exact = false"):
        make_exact(plain)


def test_moe_config_takes_exact():
    result = molt("config", str(ROOT / "configs/tiny_moe_cpu.toml"), *EXACT)
    assert result.returncode == 0, result.stderr


LORA = ["--set", "actor.lora.rank=8", "--set", "actor.lora.alpha=16.0", "--set", "actor.lr=0.01",
        "--set", "actor.lora.engine_weights=separate", "--set", "run.sync=true"]  # fmt: skip
"""A LoRA policy whose engines keep the adapters as LoRA layers of their own, computed as the trainer's;
synchronous, so every step's tokens come from the adapters the trainer holds (after the first, B != 0)."""


@pytest.mark.slow
@pytest.mark.parametrize("config", ["tiny_cpu", "tiny_moe_cpu", "tiny_cpu+lora"])
def test_exact_run_has_same_version_ratios_of_exactly_one(tmp_path, config):
    """A real tiny run (launcher, engine pool, FSDP trainer packing its rows; the MoE one with router replay):
    every same-version token's trainer log-prob equals the engine's, so the observatory's max |Δ log p| is 0 at
    every step that has them, and the first step, all of whose tokens are of the trainer's version, has every
    importance ratio at 1."""
    config, _, lora = config.partition("+")
    result = molt("run", f"configs/{config}.toml", *EXACT, *(LORA if lora else []), "--set", "run.steps=3",
                  "--set", f"run.root={tmp_path}", "--set", "logging.progress=lines", timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    actor = read_metrics(tmp_path / config.replace("_", "-") / "metrics.jsonl", source="actor")
    assert [r["step"] for r in actor] == [1, 2, 3]
    # a step whose groups are all one version behind has no same-version token to compare (it depends on
    # when the refits land); the first step's are all of version 0, the trainer's
    same = [r for r in actor if r.get("mismatch_tokens", 0) > 0]
    assert same and same[0] is actor[0], json.dumps(actor)
    assert all(r["mismatch_abs_max"] == 0.0 for r in same), json.dumps(actor)
    first = actor[0]
    assert first["ratio_min"] == first["ratio_max"] == 1.0 and first["kl_rollout"] == 0.0
    if lora:  # every step on-policy, the adapters moving: every ratio exactly 1
        assert all(r["ratio_min"] == r["ratio_max"] == 1.0 and r["kl_rollout"] == 0.0 for r in actor), actor
        assert len(same) == 3 and all(r["grad_norm"] > 0 for r in actor), json.dumps(actor)
    if config == "tiny_moe_cpu":  # the trainer's live routing is the engine's, token for token
        assert first["routing_agreement"] == 1.0
