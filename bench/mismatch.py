"""Where the train–inference gap comes from: the built-in engine's next-token distributions against the
trainer's forward, for the same tokens and the same weights, by precision and batch size.

The engine side is the engine's own model runner (`molt_hpc.engine.batch.ModelRunner`): a left-padded
prefill of `batch` prompts, then one decode step per token with the KV cache, sampling at temperature 1.
The trainer side is one right-padded forward over the finished sequences, as a training step computes
them. Per generated position both full distributions are compared: total-variation distance
`0.5 Σ|p_engine − p_trainer|`, the overlap of their top-10 tokens, and `|Δ log p|` of the sampled token
(what the IS ratio and the observatory's `mismatch_*` metrics see). First tokens (from the prefill) and
later tokens (from decode steps) are reported apart. The baseline row, measured in the same run, is
float32 at batch 1; the ratio column is each row's mean |Δ log p| over it.

vLLM's side is not here: it needs a GPU and its own process (`bench/gpu_vllm.py` measures its gap in a
real run, as `mismatch_*` metrics).

    python bench/mismatch.py                                  # the tiny model on the CPU
    python bench/mismatch.py --model DIR --device cuda --batch 1 8 64 --tokens 64
"""

import argparse
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from molt_hpc.engine.batch import ModelRunner  # noqa: E402
from molt_hpc.models import load_causal_lm  # noqa: E402

TOP = 10


def engine_side(model, device, prompts: list[list[int]], tokens: int, seed: int):
    """(sampled tokens [B, T], engine log-prob distributions [B, T, V]) from prefill + decode steps."""
    runner = ModelRunner(model, device)
    gen = torch.Generator(device=device).manual_seed(seed)
    logits, batch = runner.prefill(prompts)
    dists, sampled = [], []
    lengths = [len(p) for p in prompts]
    for step in range(tokens):
        logp = torch.log_softmax(logits.float(), dim=-1)
        tok = torch.multinomial(logp.exp(), 1, generator=gen).view(-1)
        dists.append(logp)
        sampled.append(tok)
        if step + 1 < tokens:
            logits = runner.decode(batch, tok.tolist(), [n + step for n in lengths])
    return torch.stack(sampled, 1), torch.stack(dists, 1)


@torch.inference_mode()
def trainer_side(model, device, prompts: list[list[int]], sampled: torch.Tensor) -> torch.Tensor:
    """The trainer's distributions [B, T, V] at the same positions: one right-padded forward."""
    seqs = [p + s for p, s in zip(prompts, sampled.tolist(), strict=True)]
    width = max(map(len, seqs))
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)], mask[i, : len(s)] = torch.tensor(s), 1
    logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits.float()
    t = sampled.shape[1]
    rows = [logits[i, len(p) - 1 : len(p) - 1 + t] for i, p in enumerate(prompts)]
    return torch.log_softmax(torch.stack(rows), dim=-1)


def compare(engine: torch.Tensor, trainer: torch.Tensor, sampled: torch.Tensor) -> dict[str, dict[str, float]]:
    tv = 0.5 * (engine.exp() - trainer.exp()).abs().sum(-1)
    top_e, top_t = engine.topk(TOP, -1).indices, trainer.topk(TOP, -1).indices
    overlap = (top_e[..., :, None] == top_t[..., None, :]).any(-1).float().mean(-1)
    delta = (engine.gather(-1, sampled[..., None]) - trainer.gather(-1, sampled[..., None])).squeeze(-1).abs()
    out = {}
    for name, cols in (("first", slice(0, 1)), ("later", slice(1, None))):
        if delta[:, cols].numel():
            out[name] = {
                "tv": tv[:, cols].mean().item(),
                "top_overlap": overlap[:, cols].mean().item(),
                "dlogp_mean": delta[:, cols].mean().item(),
                "dlogp_max": delta[:, cols].max().item(),
            }
    return out


def prompts_for(batch: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(4, 24, (batch,), generator=gen).tolist()
    return [torch.randint(4, vocab, (n,), generator=gen).tolist() for n in lengths]


def model_dir(args) -> Path:
    if args.model:
        return Path(args.model)
    from molt_hpc.config import MoltConfig
    from molt_hpc.models import build_tiny

    return build_tiny(Path(tempfile.mkdtemp(prefix="molt-mismatch-")), MoltConfig().model.tiny)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="an HF model directory (default: the tiny model, built here)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--batch", nargs="+", type=int, default=[1, 8, 64])
    parser.add_argument("--tokens", type=int, default=16, help="tokens generated per prompt")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(f"# bench/mismatch.py {vars(args)}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    path, device = model_dir(args), torch.device(args.device)
    print("| dtype | batch | tokens | TV first | TV later | top-10 overlap | mean abs dlogp | max abs dlogp | ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    base = None
    for dtype in args.dtypes:
        model = load_causal_lm(path, dtype=dtype, device=args.device)
        for batch in args.batch:
            prompts = prompts_for(batch, model.config.vocab_size, args.seed)
            sampled, engine = engine_side(model, device, prompts, args.tokens, args.seed)
            got = compare(engine, trainer_side(model, device, prompts, sampled), sampled)
            both = [got[k] for k in ("first", "later") if k in got]
            mean = sum(g["dlogp_mean"] for g in both) / len(both)
            base = mean if base is None else base
            ratio = f"{mean / base:.1f}×" if base > 0 else ("1.0×" if mean == 0 else "inf")
            later = got.get("later", {"tv": float("nan")})
            overlap = min(g["top_overlap"] for g in both)
            print(
                f"| {dtype} | {batch} | {sampled.numel()} | {got['first']['tv']:.2e} | {later['tv']:.2e} | "
                f"{overlap:.3f} | {mean:.2e} | {max(g['dlogp_max'] for g in both):.2e} | {ratio} |"
            )


if __name__ == "__main__":
    main()
