"""The planner's trainer peak against a memory trace of the trainer's real update, within ±5%.

`tests/plan_trace.py` runs the trainer's own code (parallelize, build_optimizer, policy_logprobs,
policy_loss, backward, optimizer_step) on 2-layer transformers models under FSDP2 at simulated world
sizes 2, 4 and 8: torch's fake process group gives FSDP2 a world of N inside one process, so
parameters, gradients and optimizer state are really sharded to 1/N and the all-gather and
reduce-scatter buffers are really allocated, while the collectives move no data (memory does not
depend on values). That is the notes' "divide parameter, gradient and optimizer bytes by N", done by
FSDP2 itself rather than by hand, so the unsharded working set is traced too. torch's
`FSDPMemTracker` records the peak; the planner predicts it from the config alone.

The shapes put the peak in different phases: the log-probs of the fused head (a vocabulary large
against the layers; with an entropy bonus, whose gradient adds a chunk-sized temporary; a head large
against the chunk, where the head gradient's per-chunk `[V, h]` product dominates), a decoder
block's backward with and without activation checkpointing (wide layers, small vocabulary), an MoE
block (experts, router), and the full-logits log-probs of a head the fused path does not take (Granite,
whose logits are divided by `logits_scaling`). Each trace also says which path the trainer took, and
the planner's `Arch.fused_head` must name the same one.
"""

import json
import subprocess
import sys

import pytest

from molt_hpc.plan.arch import arch_from_config
from molt_hpc.plan.shape import Shape
from molt_hpc.plan.trainer import trainer_memory
from tests.conftest import ROOT
from tests.plan_trace import model_config

pytestmark = pytest.mark.slow

BASE = dict(world=[2, 4, 8], layers=2, rows=2, prompt=32, pad=0, chunk=256)
SPECS = [
    dict(BASE, hidden=256, intermediate=768, heads=4, kv_heads=2, vocab=8192, tied=False, seq=512, ac=False),
    dict(BASE, hidden=512, intermediate=1536, heads=8, kv_heads=2, vocab=1024, tied=True, seq=1024, ac=False),
    dict(BASE, hidden=512, intermediate=1536, heads=8, kv_heads=2, vocab=1024, tied=True, seq=1024, ac=True),
    dict(BASE, hidden=256, intermediate=512, heads=4, kv_heads=2, vocab=2048, tied=False, seq=512, ac=False,
         experts=8, top_k=2, moe_intermediate=256),
    # 4 rows of 224 action positions: every chunk but the last crosses rows, so is gathered (the worst case)
    dict(BASE, world=[2, 8], hidden=256, intermediate=768, heads=4, kv_heads=2, vocab=8192, tied=False, rows=4,
         seq=256, ac=False, logits_scaling=4.0),
    dict(BASE, world=[2, 8], hidden=256, intermediate=768, heads=4, kv_heads=2, vocab=8192, tied=False, seq=512,
         ac=False, entropy_coef=0.01),
    # a (tied) head large against the chunk: the head gradient's per-chunk [V, h] product and its fp32 cast
    dict(BASE, world=[2, 8], hidden=512, intermediate=1024, heads=8, kv_heads=2, vocab=8192, tied=True, seq=256,
         chunk=64, ac=False),
]  # fmt: skip


def predict(spec: dict, world: int):
    arch = arch_from_config(model_config(spec))
    shape = Shape(
        ranks=world, cp=1, ep=1, rows=spec["rows"], seq=spec["seq"] - spec["pad"], micro_batches=1,
        compute_bytes=2, ac=spec["ac"], chunk=spec["chunk"], fused_head=arch.fused_head,
        entropy_grad=spec.get("entropy_coef", 0) > 0, kv_repeat=False,  # full rows: no mask
        fused_adam=False, offload="none", reference=False, critic=False, freeze_router=True,  # foreach AdamW on CPU
    )  # fmt: skip
    return trainer_memory(arch, shape)


@pytest.fixture(scope="module")
def traces() -> list[dict]:
    out = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "plan_trace.py"), json.dumps(SPECS)],
        capture_output=True, text=True, timeout=900, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == sum(len(s["world"]) for s in SPECS)
    return rows


def test_predicted_peak_is_within_5_percent_of_the_trace(traces) -> None:
    report, worst = [], 0.0
    for row in traces:
        mem = predict(row, row["world"])
        err = mem.peak.total / row["peak"] - 1
        worst = max(worst, abs(err))
        kind = "moe" if row.get("experts") else f"h{row['hidden']} V{row['vocab']} ac={row['ac']}"
        kind += " scaled logits" if row.get("logits_scaling") else " entropy" if row.get("entropy_coef") else ""
        kind += f" chunk {row['chunk']}" if row["chunk"] != BASE["chunk"] else ""
        mib = (row["peak"] / 2**20, mem.peak.total / 2**20)
        report.append(
            f"{kind} N={row['world']}: trace {mib[0]:.1f} MiB, plan {mib[1]:.1f} MiB ({err:+.1%}) at {mem.peak.name}"
        )
    print("\n".join(report))
    assert worst <= 0.05, "\n".join(report)


def test_the_plan_takes_the_trainers_log_prob_path(traces) -> None:
    """`Arch.fused_head` (the static rule on the meta build) is what the trainer decided on real weights."""
    paths = {(row.get("logits_scaling", 0), row["fused_head"]) for row in traces}
    assert paths == {(0, True), (4.0, False)}
    for row in traces:
        assert arch_from_config(model_config(row)).fused_head is row["fused_head"]


def test_sharded_state_is_one_nth(traces) -> None:
    """Parameters and optimizer state in the trace shrink as 1/N, as the plan's do."""
    for row in traces:
        cat = row["by_category"]
        mem = predict(row, row["world"])
        assert cat["_FSDPRefType.SHARDED_PARAM"] == pytest.approx(mem.state["parameters"], rel=0.01)
        assert cat["_FSDPRefType.OPT"] == pytest.approx(mem.state["optimizer"], rel=0.01)
