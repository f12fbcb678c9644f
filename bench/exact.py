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


def rollout(model, requests: int, new: int, seed: int) -> tuple[float, list[Row]]:
    """(seconds, finished rows) of `requests` requests through the scheduler."""
    sched = Scheduler(ModelRunner(model, CPU), eos_ids=set(), max_batch=64, max_model_len=512, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    rows = [
        Row(torch.randint(4, 100, (int(torch.randint(8, 41, (1,), generator=gen)),), generator=gen).tolist(),
            SamplingParams(max_tokens=new, ignore_eos=True, temperature=1.0), Future())
        for _ in range(requests)
    ]  # fmt: skip
    t0 = time.process_time()
    for row in rows[: requests // 2]:
        sched.submit(row)
    for _ in range(3):
        sched._step()
    for row in rows[requests // 2 :]:
        sched.submit(row)
    while sched.rows or sched.waiting:
        sched._step()
    return time.process_time() - t0, rows


def train_pass(model, rows: list[Row], pack: bool) -> tuple[float, torch.Tensor, torch.Tensor]:
    """(seconds of an old-policy forward plus a forward and backward, trainer log-probs, engine log-probs)."""
    trajs = [Trajectory(r.context, len(r.prompt), [(len(r.prompt), r.length)], r.logprobs, [0] * len(r.tokens), 1.0)
             for r in rows]  # fmt: skip
    exp = make_experience(trajs, max_len=128, pack=pack)
    if not pack:  # as the trainer runs padded rows: cut to the longest (`actor.packing.padded`)
        exp = padded(exp, torch.arange(exp.sequences.shape[0])).batch
    model.zero_grad(set_to_none=True)
    t0 = time.process_time()
    with torch.no_grad():
        old = policy_logprobs(model, exp, 1.0, 1024)[0]
    policy_logprobs(model, exp, 1.0, 1024)[0][exp.action_mask].sum().backward()
    return time.process_time() - t0, old[exp.action_mask], exp.action_log_probs[exp.action_mask]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--new", type=int, default=16, help="tokens generated per request")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--moe", action="store_true", help="the tiny MoE model (builtin:tiny-moe) instead")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        spec = MoltConfig().model
        built = build_tiny_moe(tmp, spec.tiny_moe) if args.moe else build_tiny(tmp, spec.tiny)
        base = load_causal_lm(built, device="cpu")
    models = {"plain": copy.deepcopy(base), "exact": make_exact(copy.deepcopy(base))}
    trainers = {}
    for name, m in models.items():
        trainers[name] = copy.deepcopy(m).train()
        use_document_attention(trainers[name], DocumentAttention("sdpa", CPU))
    times: dict[str, dict[str, list[float]]] = {n: {"rollout": [], "packed": [], "padded": []} for n in models}
    tokens = args.requests * args.new
    for rep in range(args.repeat + 1):  # the first round warms up and is not counted
        for name, model in models.items():
            secs, rows = rollout(model, args.requests, args.new, seed=rep)
            packed_s, mine, theirs = train_pass(trainers[name], rows, pack=True)
            padded_s, _, _ = train_pass(models[name].train(), rows, pack=False)
            models[name].eval()
            if name == "exact":
                assert torch.equal(mine, theirs), "exact log-probs differ from the engine's"
            if rep:
                times[name]["rollout"].append(secs)
                times[name]["packed"].append(packed_s)
                times[name]["padded"].append(padded_s)
    med = {n: {k: statistics.median(v) for k, v in t.items()} for n, t in times.items()}
    model = "tiny MoE model" if args.moe else "tiny model"
    print(f"{model}, {args.requests} requests x {args.new} tokens, {torch.get_num_threads()} threads, "
          f"median of {args.repeat}, CPU seconds")  # fmt: skip
    print(f"{'':32}{'plain':>10}{'exact':>10}{'exact/plain':>13}")
    p, e = tokens / med["plain"]["rollout"], tokens / med["exact"]["rollout"]
    print(f"{'rollout tokens/s':32}{p:>10.0f}{e:>10.0f}{p / e:>12.2f}x slower")
    for key, label in (("packed", "trainer packed fwd+bwd CPU s"), ("padded", "trainer padded fwd+bwd CPU s")):
        p, e = med["plain"][key], med["exact"][key]
        print(f"{label:32}{p:>10.3f}{e:>10.3f}{e / p:>12.2f}x")


if __name__ == "__main__":
    main()
