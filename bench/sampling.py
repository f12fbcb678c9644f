"""Drawing a batch of seeded requests' tokens: one generator per row (the engine's former path, and vLLM's for
seeded requests) against the one-pass inverse-CDF draw from per-row splitmix64 bits (`engine/sampling.py`).

Every rollout request carries a seed (`agents/step_runner.py`: reproducible samples), so this is the draw of
every decode step of a run. The baseline keeps a `torch.Generator` per row and calls `torch.multinomial` once
per row; the new draw computes each row's 32 bits on the host and samples the whole batch at once (on a GPU,
inside the decode step's CUDA graph, where the baseline could not go). Both sample the same processed
log-probs; each row is timed with its read-back, as the engine reads tokens back once a step.

    python bench/sampling.py [--device cpu|cuda] [--vocab 49152] [--rows 8,64,128,256] [--repeat 20]
"""

import argparse
import random
import statistics
import sys

import torch
from gpu_common import timed

from molt_hpc.engine.sampling import inverse_cdf, seeded_bits


def median_s(fn, device: torch.device, repeat: int) -> float:
    """Median seconds of `fn()` over `repeat` calls after one warm-up."""
    fn()
    return statistics.median(timed(fn, device) for _ in range(repeat))


def per_row(logp: torch.Tensor, generators: list[torch.Generator]) -> list[int]:
    out = torch.empty(len(generators), dtype=torch.long, device=logp.device)
    for i, gen in enumerate(generators):
        out[i] = torch.multinomial(logp[i].exp(), 1, generator=gen)[0]
    return out.tolist()


def batched(logp: torch.Tensor, seeds: list[int], index: int) -> list[int]:
    bits = torch.tensor([seeded_bits(s, index) for s in seeds], dtype=torch.int64)
    return inverse_cdf(logp, bits).tolist()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--vocab", type=int, default=49152, help="SmolLM2's vocabulary")
    ap.add_argument("--rows", default="8,64,128,256")
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    device = torch.device(args.device)
    print(f"bench/sampling.py --device {args.device} --vocab {args.vocab} --rows {args.rows} --repeat {args.repeat}")
    print("| rows | a generator per row (baseline) | one-pass inverse CDF | speed-up |\n|---:|---:|---:|---:|")
    for b in (int(r) for r in args.rows.split(",")):
        logp = torch.log_softmax(torch.randn(b, args.vocab, device=device) * 3, -1)
        seeds = [random.Random(i).getrandbits(63) for i in range(b)]
        gens = [torch.Generator(device=device).manual_seed(s) for s in seeds]
        old = median_s(lambda logp=logp, gens=gens: per_row(logp, gens), device, args.repeat)
        new = median_s(lambda logp=logp, seeds=seeds: batched(logp, seeds, 5), device, args.repeat)
        print(f"| {b} | {1e3 * old:.2f} ms | {1e3 * new:.2f} ms | {old / new:.1f}x |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
