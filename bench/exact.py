"""What `engines.exact` costs: rollout tokens/s and the trainer's log-prob forward + backward, with and
without the batch-invariant forwards, in the same run, on the same model and inputs.

Rollout: the real scheduler over the real `ModelRunner` (growing KV cache) generates `--requests`
requests of `--new` tokens each (prompts of 8-40 tokens), half of them joining after a few decode steps;
tokens/s is generated tokens over wall time. Trainer: `policy_logprobs` over the finished sequences as
a step runs them (packed rows under the trainer's document attention, or right-padded rows), the no-grad
forward a step spends on the old policy plus a forward and backward of the log-probs' sum. Each case is
timed `--repeat` times in process CPU seconds (all threads; on a shared machine wall time mostly
measures the neighbours), the plain and exact runs interleaved, and the median is reported; the ratio
is exact over plain. The exact side also checks that its log-probs equal the engine's, bit for bit.

    python bench/exact.py                       # the tiny model on the CPU
    python bench/exact.py --requests 128 --new 32 --repeat 5
    python bench/exact.py --moe                 # the tiny MoE (8 experts, top-2) instead
    python bench/exact.py --device cuda --model DIR --dtype bfloat16 --requests 64 --new 64

On a GPU the times are wall seconds (synchronised), the exact engine is what the engine runs there (the slot
runner replaying CUDA graphs of its exact forwards, `engine.main.model_runner`'s choice; the plain column
stays the eager plain runner), and one more column shows what the engine and the trainer run normally
there: the engine's slot runner with CUDA graphs and the trainer's triton log-prob kernel over document
attention's varlen kernel.
"""

import argparse
import copy
import statistics
import sys
import tempfile
import time
from concurrent.futures import Future
from pathlib import Path

import torch
from torch import Tensor

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from molt_hpc.actor.batch import policy_logprobs  # noqa: E402
from molt_hpc.actor.packing import padded  # noqa: E402
from molt_hpc.algorithm import make_experience  # noqa: E402
from molt_hpc.config import MoltConfig  # noqa: E402
from molt_hpc.engine.batch import ModelRunner, Row  # noqa: E402
from molt_hpc.engine.sampling import SamplingParams  # noqa: E402
from molt_hpc.engine.scheduler import Scheduler  # noqa: E402
from molt_hpc.models import build_tiny, build_tiny_moe, load_causal_lm  # noqa: E402
from molt_hpc.models.exact import make_exact  # noqa: E402
from molt_hpc.parallel.attention import DocumentAttention, use_document_attention  # noqa: E402
from molt_hpc.trajectory import Trajectory  # noqa: E402

CPU = torch.device("cpu")


def clock(device: torch.device) -> float:
    """Process CPU seconds on the CPU (wall time mostly measures the neighbours there); synchronised wall
    seconds on a GPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return time.perf_counter()
    return time.process_time()


def runner_of(model, device: torch.device, engine: bool):
    """The plain `ModelRunner`, or the runner the engine takes for this model and device (on a GPU the slot
    runner with CUDA graphs; for an exact model its exact slot forwards)."""
    if not engine:
        return ModelRunner(model, device)
    from molt_hpc.engine.main import model_runner

    eng = MoltConfig().engines.model_copy(update={"max_batch": 64, "max_model_len": 512})
    return model_runner(model, device, eng, None, graphs=True)


def graphs_of(runner) -> str:
    """How many decode and prefill graphs a runner recorded (what an exact engine replays on a GPU)."""
    graphs = getattr(runner, "graphs", None)
    decode = len(graphs.graphs) + len(graphs.sampled) if graphs is not None else 0  # logits and sampling graphs
    prefill = len(runner.prefiller.recorded) if getattr(runner, "prefiller", None) is not None else 0
    return f"{type(runner).__name__}, {decode} decode and {prefill} prefill CUDA graphs"


def rollout(model, requests: int, new: int, seed: int, device=CPU, engine=False) -> tuple[float, list[Row], object]:
    """(seconds, finished rows, the runner) of `requests` requests through the scheduler."""
    runner = runner_of(model, device, engine)
    sched = Scheduler(runner, eos_ids=set(), max_batch=64, max_model_len=512, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    rows = [
        Row(torch.randint(4, 100, (int(torch.randint(8, 41, (1,), generator=gen)),), generator=gen).tolist(),
            SamplingParams(max_tokens=new, ignore_eos=True, temperature=1.0), Future())
        for _ in range(requests)
    ]  # fmt: skip
    t0 = clock(device)
    for row in rows[: requests // 2]:
        sched.submit(row)
    for _ in range(3):
        sched._step()
    for row in rows[requests // 2 :]:
        sched.submit(row)
    while sched.rows or sched.waiting:
        sched._step()
    return clock(device) - t0, rows, runner


def train_pass(model, rows: list[Row], pack: bool, device=CPU, kernel="torch") -> tuple[float, Tensor, Tensor]:
    """(seconds of an old-policy forward plus a forward and backward, trainer log-probs, engine log-probs)."""
    trajs = [Trajectory(r.context, len(r.prompt), [(len(r.prompt), r.length)], r.logprobs, [0] * len(r.tokens), 1.0)
             for r in rows]  # fmt: skip
    exp = make_experience(trajs, max_len=128, pack=pack)
    if not pack:  # as the trainer runs padded rows: cut to the longest (`actor.packing.padded`)
        exp = padded(exp, torch.arange(exp.sequences.shape[0])).batch
    exp = exp.to(device)
    model.zero_grad(set_to_none=True)
    t0 = clock(device)
    with torch.no_grad():
        old = policy_logprobs(model, exp, 1.0, 1024, kernel)[0]
    policy_logprobs(model, exp, 1.0, 1024, kernel)[0][exp.action_mask].sum().backward()
    return clock(device) - t0, old[exp.action_mask], exp.action_log_probs[exp.action_mask]


def load(args) -> torch.nn.Module:
    """The bench's model: `--model DIR`, else the tiny (or tiny MoE) model built in a temporary directory."""
    if args.model:
        return load_causal_lm(args.model, device=args.device, dtype=args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        spec = MoltConfig().model
        built = build_tiny_moe(tmp, spec.tiny_moe) if args.moe else build_tiny(tmp, spec.tiny)
        return load_causal_lm(built, device=args.device, dtype=args.dtype)


def measure(args, base) -> dict[str, dict[str, list[float]]]:
    """Per form, the seconds of each repeat: rollout, packed and padded trainer passes. On a GPU also `normal`:
    the graphed engine and the trainer's triton kernel; every trainer attends by document (`sdpa`, which on CUDA
    in half precision is torch's varlen flash kernel; the exact model switches itself to its own kernel)."""
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    models = {"plain": copy.deepcopy(base), "exact": make_exact(copy.deepcopy(base))}
    if gpu:
        models["normal"] = copy.deepcopy(base)
    trainers = {}
    for name, m in models.items():
        trainers[name] = copy.deepcopy(m).train()
        use_document_attention(trainers[name], DocumentAttention("sdpa", device))
    times = {n: {"rollout": [], "packed": [], "padded": []} for n in models}
    for rep in range(args.repeat + 1):  # the first round warms up (and captures graphs) and is not counted
        for name, model in models.items():
            engine = name == "normal" or (gpu and name == "exact")
            secs, rows, runner = rollout(model, args.requests, args.new, seed=rep, device=device, engine=engine)
            if gpu and not rep:
                print(f"{name} engine: {graphs_of(runner)}")
            kernel = "triton" if name == "normal" else "torch"
            packed_s, mine, theirs = train_pass(trainers[name], rows, True, device, kernel)
            padded_s, _, _ = train_pass(models[name].train(), rows, False, device, kernel)
            models[name].eval()
            if name == "exact":
                assert torch.equal(mine, theirs), "exact log-probs differ from the engine's"
            if rep:
                for key, value in (("rollout", secs), ("packed", packed_s), ("padded", padded_s)):
                    times[name][key].append(value)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--new", type=int, default=16, help="tokens generated per request")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--moe", action="store_true", help="the tiny MoE model (builtin:tiny-moe) instead")
    parser.add_argument("--model", help="a model directory instead of the tiny model")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    print("arguments:", vars(args))
    base = load(args)
    if args.device == "cuda":  # which form exact attention takes on this GPU (models.exact_cuda_attention.usable)
        from molt_hpc.models.exact_cuda_attention import usable

        c = base.config
        heads, kv = c.num_attention_heads, getattr(c, "num_key_value_heads", None) or c.num_attention_heads
        d = getattr(c, "head_dim", None) or c.hidden_size // heads
        form = "the fused kernel" if usable(d, heads, kv, base.dtype, torch.device("cuda")) else "block multiplies"
        print(f"exact attention on this GPU: {form}")
    med = {n: {k: statistics.median(v) for k, v in t.items()} for n, t in measure(args, base).items()}
    model = args.model or ("tiny MoE model" if args.moe else "tiny model")
    unit = "wall seconds" if args.device == "cuda" else f"{torch.get_num_threads()} threads, CPU seconds"
    print(f"{model} ({args.dtype}, {args.device}), {args.requests} requests x {args.new} tokens, "
          f"median of {args.repeat}, {unit}")  # fmt: skip
    forms = [n for n in ("normal", "plain") if n in med]
    print(f"{'':32}" + "".join(f"{n:>10}" for n in [*forms, "exact"]) + "".join(f"{'exact/' + n:>14}" for n in forms))
    tokens = args.requests * args.new
    rate = {n: tokens / med[n]["rollout"] for n in med}
    print(f"{'rollout tokens/s':32}" + "".join(f"{rate[n]:>10.0f}" for n in [*forms, "exact"])
          + "".join(f"{rate[n] / rate['exact']:>13.2f}x" for n in forms) + "  (slower)")  # fmt: skip
    for key, label in (("packed", "trainer packed fwd+bwd s"), ("padded", "trainer padded fwd+bwd s")):
        print(f"{label:32}" + "".join(f"{med[n][key]:>10.3f}" for n in [*forms, "exact"])
              + "".join(f"{med['exact'][key] / med[n][key]:>13.2f}x" for n in forms))  # fmt: skip


if __name__ == "__main__":
    main()
