"""LoRA refits: the trainer sends its adapters alone; the builtin engine merges them into the base it kept,
or receives them into LoRA layers of its own (`actor.lora.engine_weights = 'separate'`).

The merge against a float64 reference; then end to end, for both forms: a real engine process (`jobs/engine.py`) and a
LoRA trainer (torchrun, 1 gloo rank) that refits at start and after each of two steps. After each refit
the engine's log-probs equal those of peft's own `PeftModel` over the checkpointed adapter directory, and
a refit that changes the base weights is refused.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from molt_hpc.engine.lora import AdapterMerge
from molt_hpc.refit.buckets import TensorMeta
from tests.conftest import ROOT
from tests.test_actor_support import make_run, put_groups, sample_groups, torchrun

PROMPT = [2, 34, 32, 18, 31, 100, 57, 18]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
"""Every linear layer of the decoder blocks and the LM head, which the tiny model ties to its embeddings:
the engine unties it, so a merge changes the output projection alone, as the trainer's adapter does."""


def test_merge_is_the_base_plus_scaled_product_from_the_kept_base() -> None:
    gen = torch.Generator().manual_seed(0)
    w32, wbf = torch.randn(6, 5, generator=gen), torch.randn(4, 3, generator=gen).bfloat16()
    params = {"a.weight": w32.clone(), "b.weight": wbf.clone(), "c.weight": torch.zeros(2)}
    merge = AdapterMerge(params)
    sent = {
        "a.lora_A.weight": torch.randn(2, 5, generator=gen), "a.lora_B.weight": torch.randn(6, 2, generator=gen),
        "b.lora_A.weight": torch.randn(2, 3, generator=gen), "b.lora_B.weight": torch.randn(4, 2, generator=gen),
    }  # fmt: skip
    metas = [TensorMeta.of(n, t) for n, t in sent.items()]
    assert merge.check(metas, 0.5) is None
    for _ in range(3):  # every refit starts from the kept base: repeating one never drifts
        for name, buf in merge.buffers(metas).items():
            buf.copy_(sent[name])
        assert merge.apply(0.5) == 2
    for target, base in (("a", w32), ("b", wbf)):
        want = base.double() + 0.5 * sent[f"{target}.lora_B.weight"].double() @ sent[f"{target}.lora_A.weight"].double()
        assert params[f"{target}.weight"].dtype == base.dtype
        tol = 1e-6 if base.dtype == torch.float32 else 2**-7 * want.abs().max().item()
        assert (params[f"{target}.weight"].double() - want).abs().max() <= tol
    only_a = [m for m in metas if m.name.startswith("a.")]
    for name, buf in merge.buffers(only_a).items():
        buf.copy_(sent[name])
    merge.apply(0.5)
    assert torch.equal(params["b.weight"], wbf)  # adapted before, not now: its base again
    assert "lacks" not in str(merge.check(metas[:1], 0.5)) and "without" in merge.check(metas[:1], 0.5)
    assert "does not have" in merge.check([TensorMeta("z.lora_A.weight", "float32", (2, 5))], 0.5)
    assert "adapters only" in merge.check([TensorMeta("a.weight", "float32", (6, 5))], 0.5)
    assert "shape" in merge.check([TensorMeta("a.lora_A.weight", "float32", (2, 4)), metas[1]], 0.5)


def test_separate_layers_receive_the_adapters_in_place(tiny_model_dir) -> None:
    from molt_hpc.config.train import LoraConfig
    from molt_hpc.engine.lora import AdapterLayers, prepare
    from molt_hpc.models import load_causal_lm
    from molt_hpc.models.lora import wire_name

    model = load_causal_lm(tiny_model_dir, dtype="float32", device="cpu")
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        before = model(input_ids=ids).logits
    scaling = prepare(model, LoraConfig(rank=4, alpha=8.0, engine_weights="separate"))
    assert scaling == 2.0 and not any(p.requires_grad for p in model.parameters())
    params = model.state_dict(keep_vars=True)
    layers = AdapterLayers(params, scaling)
    sent = {wire_name(n): t for n, t in params.items() if ".lora_" in n}
    metas = [TensorMeta.of(n, t) for n, t in sent.items()]
    assert layers.check(metas, 2.0) is None
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, before)  # B = 0: version 0 is the base
        gen = torch.Generator().manual_seed(0)
        for name, buf in layers.buffers(metas).items():
            assert buf is params[name.replace(".lora_A.", ".lora_A.default.").replace(".lora_B.", ".lora_B.default.")]
            buf.copy_(torch.randn(buf.shape, generator=gen))
        assert layers.apply(2.0) == len(metas) // 2
        assert not torch.allclose(model(input_ids=ids).logits, before, atol=1e-3)
    assert "scale by 2.0" in layers.check(metas, 4.0)
    assert "adapters only" in layers.check([TensorMeta("model.norm.weight", "float32", (8,))], 2.0)
    wrong = TensorMeta(metas[0].name, "float32", (metas[0].shape[0] + 1, metas[0].shape[1]))
    assert "LoRA layer" in layers.check([wrong], 2.0)


def _engine(run_dir: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log = open(run_dir / "logs" / f"engine-{time.monotonic_ns()}.log", "w")  # noqa: SIM115 - closed by the OS at exit
    cmd = [sys.executable, str(ROOT / "jobs" / "engine.py"), str(run_dir), "--role", "engine", "--index", "0"]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def call(run_dir: Path, path: str, body: dict | None = None) -> dict:
    import urllib.request

    reg = json.loads((run_dir / "rendezvous" / "engine-0.json").read_text())
    token = (run_dir / "rendezvous" / "token").read_text().strip()
    req = urllib.request.Request(
        reg["url"] + path,
        data=None if body is None else json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


def until(cond, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def version_is(run_dir: Path, version: int) -> bool:
    try:
        return call(run_dir, "/health")["weight_version"] == version
    except (OSError, FileNotFoundError, json.JSONDecodeError):  # not up yet
        return False


def engine_tables(run_dir: Path) -> tuple[list[int], list[dict[int, float]]]:
    out = call(run_dir, "/inference/v1/generate", {
        "token_ids": PROMPT,
        "sampling_params": {"temperature": 1.0, "max_tokens": 3, "logprobs": -1, "seed": 1, "ignore_eos": True},
    })["choices"][0]  # fmt: skip
    return out["token_ids"], [
        {e["token_id"]: e["logprob"] for e in s["top_logprobs"]} for s in out["logprobs"]["content"]
    ]


def peft_logprobs(base_dir: Path, adapter_dir: Path | None, tokens: list[int]) -> torch.Tensor:
    """peft's own forward of the base with the saved adapters: the log-softmax at each generated step."""
    from peft import PeftModel

    from molt_hpc.models import load_causal_lm

    model = load_causal_lm(base_dir)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, str(adapter_dir))
    ids = torch.tensor([PROMPT + tokens])
    with torch.no_grad():
        logits = model(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None]).logits[0].float()
    return logits.log_softmax(-1)[len(PROMPT) - 1 : len(PROMPT) - 1 + len(tokens)]


def max_diff(tables: list[dict[int, float]], rows: torch.Tensor) -> float:
    return max(abs(t[i] - float(row[i])) for t, row in zip(tables, rows, strict=True) for i in range(row.shape[0]))


@pytest.fixture(scope="module", params=["merged", "separate"])
def refitted(request, tmp_path_factory, tiny_model_dir):
    """Both forms of the engine's adapters (`actor.lora.engine_weights`): merged into its weights, and its own
    LoRA layers."""
    torch.set_num_threads(1)
    cfg, run = make_run(tmp_path_factory.mktemp("lora-refit"), "lora-refit", tiny_model_dir, [
        f"actor.lora.engine_weights={request.param}",
        "rollout.n_samples=4", "actor.groups_per_step=1", "run.steps=2", "checkpoint.interval=1",
        "checkpoint.keep_last=3", "engines.threads=1", "actor.lora.rank=4", "actor.lora.alpha=8.0", "actor.lr=0.01",
        f"actor.lora.target_modules={TARGETS}",
    ])  # fmt: skip
    groups = sample_groups(tiny_model_dir, 2, 4, seed=11)
    engine = _engine(run.path)
    trainer, seen, refused = None, {}, None
    try:
        until(lambda: version_is(run.path, 0), "the engine")
        seen[0] = engine_tables(run.path)
        put_groups(cfg, run, groups[:1])
        trainer = torchrun(run.path, 1, wait=False)
        until(lambda: version_is(run.path, 1), "refit v1")
        seen[1] = engine_tables(run.path)
        put_groups(cfg, run, groups[1:])
        assert trainer.wait(timeout=120) == 0
        seen[2] = engine_tables(run.path)
        refused = push_full_weights(run, cfg, tiny_model_dir)
        seen["version_after_refusal"] = call(run.path, "/health")["weight_version"]
    finally:
        for p in (engine, trainer):
            if p is not None and p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    return run, seen, refused


def push_full_weights(run, cfg, model_dir: Path) -> str:
    """A refit of full weights (the base's) to the LoRA run's engine; the error it ends with."""
    from safetensors.torch import load_file

    from molt_hpc.refit import RefitSender

    reg = json.loads((run.path / "rendezvous" / "engine-0.json").read_text())
    sender = RefitSender(run.path, cfg.refit, run.token())
    try:
        sender.connect([reg["url"]])
        tensors = list(load_file(str(model_dir / "model.safetensors")).items())
        sender.push(tensors, version=99)
    except (ValueError, RuntimeError) as err:
        return str(err)
    finally:
        sender.close()
    return ""


def test_engine_serves_the_trainers_adapters_after_each_refit(refitted, tiny_model_dir) -> None:
    run, seen, _ = refitted
    tokens, tables = seen[0]
    assert max_diff(tables, peft_logprobs(tiny_model_dir, None, tokens)) < 1e-5  # version 0: the base
    for step in (1, 2):
        tokens, tables = seen[step]
        adapter = run.checkpoints / f"step_{step:06d}" / "policy"
        assert max_diff(tables, peft_logprobs(tiny_model_dir, adapter, tokens)) < 1e-5, step
    tokens, tables = seen[2]
    assert max_diff(tables, peft_logprobs(tiny_model_dir, None, tokens)) > 1e-3  # the adapters moved the policy


def test_refits_send_only_the_adapters(refitted, tiny_model_dir) -> None:
    run, _, _ = refitted
    log = "\n".join(p.read_text() for p in (run.path / "logs").glob("torchrun-*.log"))
    sizes = [float(x.split(": ")[1].split(" MB")[0]) for x in log.split("refit v")[1:]]
    # 2 blocks x (q, k, v, o, gate, up, down) and the head, A [4, in] + B [out, 4] each, fp32; the model is ~1.3 MB
    model = (tiny_model_dir / "model.safetensors").stat().st_size
    assert len(sizes) == 3 and all(s <= 0.1 for s in sizes) and model > 1e6, (sizes, model)


def test_a_refit_that_changes_the_base_is_refused(refitted) -> None:
    _, seen, refused = refitted
    assert "LoRA run" in refused and "refused" in refused
    assert seen["version_after_refusal"] == 2  # paused at version 2 until a complete (adapter) refit
