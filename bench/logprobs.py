"""Chunked log-probs + entropy (`molt_hpc.algorithm.logprobs`) vs the naive full-vocabulary recipe.

Forward and backward of log p(target) and entropy from last hidden states and the LM head, timed,
with the peak memory each needs beyond its inputs. Baseline, in the same run: `log_softmax` over
`(hidden @ W.T).float() / T`. On CUDA the peak comes from the allocator; on CPU each variant runs
in a fresh subprocess and the peak is the growth of its max RSS.

    python bench/logprobs.py            # CUDA when available (bf16, Qwen-sized vocabulary), else a CPU size
    python bench/logprobs.py --tokens 4096 --vocab 65536 --hidden 512 --device cpu
"""

import argparse
import json
import resource
import subprocess
import sys
import time

import torch

from molt_hpc.algorithm.logprobs import token_logprobs


def naive(hidden, weight, seqs, temperature):
    logp_all = torch.log_softmax((hidden @ weight.t()).float() / temperature, dim=-1)
    logp = logp_all[:, :-1].gather(2, seqs[:, 1:, None]).squeeze(2)
    ent = -(logp_all.exp() * logp_all).sum(-1)[:, :-1]
    return logp, ent


def chunked(chunk):
    def run(hidden, weight, seqs, temperature):
        logp, ent = token_logprobs(hidden, seqs, lm_head_weight=weight, temperature=temperature, chunk=chunk)
        return logp[:, 1:], ent[:, 1:]

    return run


def inputs(args):
    dtype = getattr(torch, args.dtype)
    g = torch.Generator(device=args.device).manual_seed(0)
    rows = args.tokens // args.seq_len
    hidden = torch.randn(rows, args.seq_len, args.hidden, device=args.device, generator=g).to(dtype)
    weight = (torch.randn(args.vocab, args.hidden, device=args.device, generator=g) * 0.02).to(dtype)
    seqs = torch.randint(0, args.vocab, (rows, args.seq_len), device=args.device, generator=g)
    return hidden.requires_grad_(True), weight.requires_grad_(True), seqs


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def measure(fn, args) -> dict:
    """Median seconds of forward+backward over `args.repeats`, and peak extra memory in MiB."""
    hidden, weight, seqs = inputs(args)
    times = []
    if args.device == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for _ in range(args.repeats):
        hidden.grad = weight.grad = None
        sync(args.device)
        t0 = time.perf_counter()
        logp, ent = fn(hidden, weight, seqs, 0.7)
        (logp.sum() + 0.01 * ent.sum()).backward()
        sync(args.device)
        times.append(time.perf_counter() - t0)
    if args.device == "cuda":
        peak_mib = (torch.cuda.max_memory_allocated() - base) / 2**20
    else:
        peak_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024
    check = (logp.detach().double().sum().item(), weight.grad.double().norm().item())
    return {"seconds": sorted(times)[len(times) // 2], "peak_mib": peak_mib, "check": check}


def run_one(name: str, args) -> dict:
    fn = naive if name == "naive" else chunked(int(name.split("=")[1]))
    if args.device == "cuda":
        try:
            return measure(fn, args)
        except torch.OutOfMemoryError:  # an out-of-memory baseline is a result: report it, go on
            torch.cuda.empty_cache()
            return {"seconds": float("nan"), "peak_mib": float("nan"), "check": (float("nan"), 0.0)}
    # a fresh process per variant, so max RSS is this variant's own high-water mark
    cmd = [sys.executable, __file__, "--one", name, *sys.argv[1:]]
    return json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)


def main() -> None:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if cuda else "cpu")
    p.add_argument("--tokens", type=int, default=16384 if cuda else 2048)
    p.add_argument("--seq-len", type=int, default=4096 if cuda else 1024)
    p.add_argument("--hidden", type=int, default=4096 if cuda else 256)
    p.add_argument("--vocab", type=int, default=151936 if cuda else 32768)
    p.add_argument("--dtype", default="bfloat16" if cuda else "float32")
    p.add_argument("--chunks", default="1024,4096" if cuda else "256,1024")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--one", help=argparse.SUPPRESS)
    args = p.parse_args()
    torch.set_num_threads(1 if args.device == "cpu" else torch.get_num_threads())
    if args.one:
        print(json.dumps(measure(naive if args.one == "naive" else chunked(int(args.one.split("=")[1])), args)))
        return
    names = ["naive"] + [f"chunk={c}" for c in args.chunks.split(",")]
    results = {n: run_one(n, args) for n in names}
    base = results["naive"]
    print(f"device={args.device} dtype={args.dtype} tokens={args.tokens} hidden={args.hidden} vocab={args.vocab}")
    print(f"{'variant':<12} {'fwd+bwd s':>10} {'x naive':>8} {'peak MiB':>10} {'x naive':>8} {'sum logp':>14}")
    for n, r in results.items():
        print(
            f"{n:<12} {r['seconds']:>10.4f} {r['seconds'] / base['seconds']:>8.2f} "
            f"{r['peak_mib']:>10.1f} {r['peak_mib'] / max(base['peak_mib'], 1e-9):>8.3f} {r['check'][0]:>14.3f}"
        )


if __name__ == "__main__":
    main()
