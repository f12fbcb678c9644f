"""Memory trace of one real trainer update at a simulated FSDP world size, in one CPU process.

    python tests/plan_trace.py '{"world": [2, 4, 8], "hidden": 256, ...}'   → one JSON line per world size

The world is torch's fake process group (`torch.testing._internal.distributed.fake_pg`): FSDP2 runs
its real code at world size N inside one process — parameters really sharded to 1/N, all-gather and
reduce-scatter buffers really allocated at full size — while collectives move no bytes. Memory does
not depend on the values, so the trace's bytes are those of rank r of a real N-rank job; the values
themselves are garbage (nothing is checked against them). Around it, `FSDPMemTracker` (a
TorchDispatchMode) records every tensor by category; the update is the trainer's own code:
`parallelize`, `build_optimizer`, `policy_logprobs`, `policy_loss`, backward, `optimizer_step`.
Two updates run and the second is reported (the first creates the optimizer state), with the path the
trainer's log-probs took (`fused_head`: from the hidden states and the head weight, or full logits).
"""

import json
import random
import sys

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

HALF = (torch.bfloat16, torch.float16)
PLAIN = (torch.Tensor, torch.nn.Parameter)  # FSDP2's unsharded parameters are plain `Parameter`s


OPS = frozenset({torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
                 torch.ops.aten._grouped_mm.default,  # the MoE experts
                 torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default})  # fmt: skip


def _up(x):
    return x.float() if type(x) in PLAIN and x.dtype in HALF else x


class Fp32Matmul(TorchDispatchMode):
    """bf16/fp16 matmuls and CPU flash-attention backward on plain CPU tensors, computed in fp32 and cast back.

    Speed only: torch's CPU kernels for these in bf16 are 7-50x slower than in fp32 (most of a trace's time
    was the bf16 attention backward and MoE grouped matmuls). The mode sits below the tracker, so the tracker
    sees only the results, with the dtype and shape the bf16 kernel gives; the fp32 temporaries are never
    recorded (the traced peaks are byte-identical either way)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        half = [a.dtype for a in args if type(a) in PLAIN and a.dtype in HALF]
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        if (
            func not in OPS
            or not half
            or kwargs.get("out_dtype") is not None
            or any(type(a) not in PLAIN for a in tensors)
        ):
            return func(*args, **kwargs)
        out = func(*map(_up, args), **{k: _up(v) for k, v in kwargs.items()})
        if isinstance(out, torch.Tensor):
            return out.to(half[0])
        return type(out)(o.to(half[0]) if isinstance(o, torch.Tensor) and o.dtype == torch.float32 else o for o in out)


def make_batch(rows: int, seq: int, prompt: int, pad: int, vocab: int):
    """`rows` samples of `seq - pad` tokens (`pad` of padding at the end of each row), as `Experience`."""
    from molt_hpc.algorithm import compute_advantages, experience_from_groups
    from molt_hpc.config.train import AlgorithmConfig
    from molt_hpc.trajectory import Group, Trajectory

    rng = random.Random(0)
    samples = []
    for i in range(rows):
        n = seq - pad
        toks = [rng.randrange(1, vocab) for _ in range(n)]
        lps = [-rng.uniform(0.5, 3.0) for _ in range(n - prompt)]
        samples.append(
            Trajectory(toks, prompt, [(prompt, n)], lps, [0] * (n - prompt), float(i % 2), rollout_id=f"s{i}")
        )
    exp = experience_from_groups([Group("g0", "p0", samples)], max_len=seq, pad_id=0)
    return compute_advantages(exp, AlgorithmConfig())


def model_config(spec: dict):
    """A Qwen2 (dense), Qwen3-MoE or, with `logits_scaling`, Granite (Llama's layout, its logits divided
    by that scale: a head the fused log-probs do not take) config of the spec's shape."""
    from transformers import GraniteConfig, Qwen2Config, Qwen3MoeConfig

    common = dict(vocab_size=spec["vocab"], hidden_size=spec["hidden"], intermediate_size=spec["intermediate"],
                  num_hidden_layers=spec["layers"], num_attention_heads=spec["heads"],
                  num_key_value_heads=spec["kv_heads"], tie_word_embeddings=spec["tied"],
                  max_position_embeddings=4 * spec["seq"])  # fmt: skip
    if spec.get("logits_scaling"):
        return GraniteConfig(**common, logits_scaling=spec["logits_scaling"])
    if spec.get("experts"):
        return Qwen3MoeConfig(
            **common,
            num_experts=spec["experts"],
            num_experts_per_tok=spec["top_k"],
            moe_intermediate_size=spec["moe_intermediate"],
            head_dim=spec["hidden"] // spec["heads"],
        )
    return Qwen2Config(**common, use_sliding_window=False)


def trace(spec: dict, world: int) -> dict:
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from transformers import AutoModelForCausalLM

    from molt_hpc.actor import build
    from molt_hpc.actor.batch import policy_logprobs
    from molt_hpc.actor.head import FUSED_OK
    from molt_hpc.actor.state import Trainable
    from molt_hpc.actor.step import optimizer_step
    from molt_hpc.algorithm import policy_loss
    from molt_hpc.algorithm.loss import global_loss_scale
    from molt_hpc.config import load_config
    from molt_hpc.parallel import parallelize

    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    try:
        mesh = init_device_mesh("cpu", (world,))
        cfg = load_config(None, [f"actor.micro_batch_size={spec['rows']}", f"actor.logprob_chunk={spec['chunk']}",
                                 f"actor.activation_checkpointing={str(spec['ac']).lower()}",
                                 f"algorithm.entropy_coef={spec.get('entropy_coef', 0.0)}"])  # fmt: skip
        config = model_config(spec)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa").train()
        build.disable_dropout(model)
        parallelize(model, mesh, cfg.actor, compute_dtype=torch.bfloat16)
        opt = build.build_optimizer(model, cfg.actor, 1e-5)
        part = Trainable("policy", model, opt, build.build_scheduler(opt, cfg.actor, 100))
        mb = make_batch(spec["rows"], spec["seq"], spec["prompt"], spec["pad"], spec["vocab"])
        count = global_loss_scale([mb.action_mask], [mb.seq_index], cfg.rollout.max_new_tokens)
        tracker = FSDPMemTracker(model, opt)
        with Fp32Matmul(), tracker:  # entered first, so below the tracker
            for it in range(2):
                logp, ent = policy_logprobs(model, mb, 1.0, cfg.actor.logprob_chunk)
                loss, _ = policy_loss(logp, mb.action_log_probs, mb.advantages, mb.action_mask, cfg.algorithm, count,
                                      seq_index=mb.seq_index, n_samples=mb.num_samples, entropy=ent)  # fmt: skip
                (loss * world).backward()
                del logp, ent, loss
                optimizer_step(part, 1.0)
                if it == 0:
                    tracker.reset_mod_stats()
        peak = tracker.get_tracker_snapshot("peak")
        dev = next(k for k in peak if str(k).startswith("cpu"))
        return {"world": world, "peak": peak[dev]["Total"], "fused_head": getattr(model, FUSED_OK),
                "by_category": {str(k): v for k, v in peak[dev].items() if k != "Total"}}  # fmt: skip
    finally:
        dist.destroy_process_group()


def main() -> None:
    torch.set_num_threads(1)
    for spec in json.loads(sys.argv[1]):
        for world in spec["world"]:
            print(json.dumps({**spec, **trace(spec, world)}), flush=True)


if __name__ == "__main__":
    from molt_hpc.log import end_process

    main()
    end_process(0)  # past the interpreter teardown, which torch's gloo threads do not survive
