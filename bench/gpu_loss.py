"""The loss alone on one GPU (0.5B vocabulary): cross-entropy against the trainer's chunked log-probs, from logits
and from hidden states with each chunk kernel, and each kernel's bf16 gap against an fp32 recompute. Run by
`bench/gpu_train.py` after its trainer rows (`--dry-run`: a tiny vocabulary on the CPU)."""

import statistics
from pathlib import Path

import torch
import torch.nn.functional as F
from gpu_common import free, peak_gib, timed_ms, write_row


def loss_kernels(seq: int, prompt: int, rows: int, device, out: Path | None, vocab: int, hidden: int) -> None:
    """Forward + backward of the loss alone on `rows × seq` positions: CE vs the trainer's log-probs, from
    logits (today's trainer: the model's full logits) and from hidden states with each chunk kernel; then
    the bf16 gap of each against an fp32 recompute of the same inputs."""
    from molt_hpc.algorithm import token_logprobs

    torch.manual_seed(0)
    ids = torch.randint(1, vocab, (rows, seq), device=device)
    mask = torch.zeros(rows, seq, dtype=torch.bool, device=device)
    mask[:, prompt:] = True
    logits = (torch.randn(rows, seq, vocab, device=device) * 2).to(torch.bfloat16).requires_grad_()
    hid = torch.randn(rows, seq, hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
    weight = (torch.randn(vocab, hidden, device=device) * 0.05).to(torch.bfloat16).requires_grad_()
    kernels = ["torch"] + (["compile", "triton"] if device.type == "cuda" else [])  # compile: minutes on a CPU

    def ce():
        F.cross_entropy(logits[:, :-1].float().reshape(-1, vocab), ids[:, 1:].reshape(-1)).backward()

    def from_logits():
        logp, _ = token_logprobs(logits, ids, mask=mask)
        logp.sum().backward()

    def from_hidden(kernel):
        def run():
            logp, ent = token_logprobs(hid, ids, lm_head_weight=weight, mask=mask, kernel=kernel)
            (logp.sum() + 0.01 * ent.sum()).backward()

        return run

    def hidden_ce():
        F.cross_entropy((hid[:, :-1] @ weight.t()).float().reshape(-1, vocab), ids[:, 1:].reshape(-1)).backward()

    def lm_head_then_logits():  # today's trainer: the model's LM head makes [B, T, V], then the chunked loss
        logp, _ = token_logprobs(hid @ weight.t(), ids, mask=mask)
        logp.sum().backward()

    cases = {
        "CE on logits (reference)": ce,
        "chunked log-probs from logits": from_logits,
        "lm_head + CE from hidden states": hidden_ce,
        "lm_head -> full logits -> chunked log-probs (before)": lm_head_then_logits,
        **{f"fused from hidden states, kernel {k}": from_hidden(k) for k in kernels},
    }
    times, peaks = {}, {}
    for name, fn in cases.items():
        runs = []
        for _ in range(6):  # the first is a warm-up (and the compile)
            for t in (logits, hid, weight):
                t.grad = None
            free()
            runs.append(timed_ms(fn, device))
        times[name], peaks[name] = statistics.median(runs[1:]), peak_gib()
    base = times["CE on logits (reference)"]
    for name, t in times.items():
        write_row(out, bench="loss", case=f"{name}, {rows}x{seq}, V={vocab}", value=t, unit="ms fwd+bwd",
                  baseline=base, ratio=t / base, note=f"peak {peaks[name]:.1f} GiB (inputs included)")  # fmt: skip
    bf16_gaps(hid, weight, ids, mask, kernels, out)


def bf16_gaps(hid, weight, ids, mask, kernels: list[str], out: Path | None) -> None:
    """Each kernel on the bf16 inputs against the torch kernel on their fp32 copies: log-probs and LM head gradient."""
    from molt_hpc.algorithm import token_logprobs

    hid32, w32 = hid.detach().float().requires_grad_(), weight.detach().float().requires_grad_()
    want, _ = token_logprobs(hid32, ids, lm_head_weight=w32, mask=mask)
    want.sum().backward()
    for k in kernels:
        hid.grad = weight.grad = None
        got, _ = token_logprobs(hid, ids, lm_head_weight=weight, mask=mask, kernel=k)
        got.sum().backward()
        gap = float((got.detach() - want.detach())[mask].abs().max())
        grad_gap = float((weight.grad.float() - w32.grad).norm() / w32.grad.norm())
        write_row(out, bench="loss", case=f"log-prob gap, bf16 inputs vs their fp32 copies, kernel {k}", value=gap,
                  unit="max abs", note=f"LM head gradient: relative L2 gap {grad_gap:.1e}")  # fmt: skip
