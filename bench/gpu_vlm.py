"""A vision-language model on vLLM 0.26, on ONE GPU: vLLM serves `builtin:tiny-vl` from its directory behind our
front, the trainer's forward on the same GPU scores vLLM's samples, and a short run trains on vLLM's rollouts.

- check: vLLM (`engines.kind = "vllm"`, bf16, eager, a quarter of the GPU) serves the tiny Qwen2-VL the run
  resolves; the colour task's prompts (`data/color_train.jsonl`, one image each) go through our front (render
  → `/inference/v1/generate` with `features`, `engine/vllm/mm.py`), 64 seeded samples of 6 tokens at temperature 1.
  This process then runs the trainer's forward (`make_experience` + `policy_logprobs`: our PIL image
  processor's pixels, our mRoPE positions, packed and padded rows) over the same traces on the same GPU, in
  bf16 and in fp32, and reports the engine-vs-trainer log-prob gap (mean |Δ| over every action token, the
  max beside it). The baseline is the image's own effect: the trainer's log-probs of the same tokens with
  another colour's image in each prompt. A gap well below it says vLLM put each image's features where the
  trainer does. Samples holding a generated vision token (the trainer drops them) are counted, not compared.
- train: `molt-hpc run configs/tiny_vl_cpu.toml` with the vLLM engine for a few steps on the same GPU (both
  pools share it). The refit between a trainer and an engine on one GPU goes through CUDA IPC
  (`molt_hpc.refit.ipc`), not NCCL. It reports the steps done, the reward, and `kl_rollout` (engine vs
  trainer log-probs on the trained tokens) of each step.

`--dry-run` runs both parts on the CPU with the builtin engine in vLLM's place (a check of the script, not a
measurement).

    python bench/gpu_vlm.py [--out rows.jsonl] [--dry-run]
"""

import argparse
import asyncio
import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path

import aiohttp
import torch
from gpu_common import gpu_env, write_row
from gpu_engine import engine_url, start_engine

from molt_hpc.config import load_config, to_toml
from molt_hpc.rundir import create_run_dir

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "tiny_vl_cpu.toml"
SAMPLES, NEW, TRAIN_STEPS = 64, 6, 8


def engine_sets(dry: bool) -> list[str]:
    if dry:
        return ["engines.kind='builtin'", "engines.device='cpu'", "actor.device='cpu'"]
    return ["engines.kind='vllm'", "engines.device='cuda'", "actor.device='cuda'", "model.dtype='bfloat16'",
            "engines.enforce_eager=true", "engines.gpu_memory_utilization=0.25"]  # fmt: skip


async def sample(url: str, token: str, prompts) -> list:
    from molt_hpc.engine.client import generate

    sp = {"max_tokens": NEW, "temperature": 1.0, "top_k": 0, "ignore_eos": True}
    async with aiohttp.ClientSession() as s:
        calls = [generate(s, url, p.token_ids, {**sp, "seed": i}, token=token, images=list(p.images))
                 for i, p in enumerate(prompts)]  # fmt: skip
        return await asyncio.gather(*calls)


def trainer_logprobs(model_dir: Path, trajs, vision, dtype: str, device: str, pack: bool) -> torch.Tensor:
    """The trainer's log-probs of every action token of `trajs` (in order), in `dtype`."""
    from molt_hpc.actor.batch import policy_logprobs
    from molt_hpc.actor.vision import ImageInputs
    from molt_hpc.algorithm import make_experience
    from molt_hpc.models import load_causal_lm
    from molt_hpc.parallel.attention import DocumentAttention, use_document_attention

    model = load_causal_lm(model_dir, dtype=dtype, device=device)
    if pack:
        use_document_attention(model, DocumentAttention("sdpa", torch.device(device)))
    exp = make_experience(trajs, max_len=256, pack=pack, vision=vision.spec).to(device)
    with torch.no_grad():
        logp, _ = policy_logprobs(model, exp, 1.0, 64, images=ImageInputs(vision))
    out = [logp[exp.seq_index == n][exp.action_mask[exp.seq_index == n]] for n in range(len(trajs))]
    return torch.cat(out).float().cpu()


def check(tmp: Path, out: Path | None, dry: bool) -> dict[str, float]:
    """Sample through the engine, score with the trainer; returns the mean gaps and the image's effect."""
    from molt_hpc.data import PromptDataset
    from molt_hpc.models import load_tokenizer, resolve_model
    from molt_hpc.trajectory import TraceImage, Trajectory
    from molt_hpc.vision.processor import Vision

    cfg = load_config(CONFIG, [f"run.root='{tmp}'", "run.name='check'", *engine_sets(dry)])
    run = create_run_dir(tmp, "check", to_toml(cfg))
    model_dir = resolve_model(cfg.model, run.models)
    vision = Vision(model_dir)
    data = cfg.data.model_copy(update={"path": str(REPO / cfg.data.path)})
    every = PromptDataset.load(data, load_tokenizer(model_dir), vision=vision, max_images=2).prompts
    prompts = every[:SAMPLES]
    proc = start_engine(run, {**gpu_env(), "CUDA_VISIBLE_DEVICES": "0"})
    try:
        outs = asyncio.run(sample(engine_url(run, proc, 900), run.token(), prompts))
    finally:
        proc.terminate()
        proc.wait(timeout=120)
    trajs, swapped, media = [], [], 0
    for i, (p, o) in enumerate(zip(prompts, outs, strict=True)):
        if not vision.spec.media_token_ids.isdisjoint(o.token_ids):
            media += 1  # a generated vision token: the trainer drops such a sample
            continue
        n, k = len(p.token_ids), len(o.token_ids)
        tokens, [im] = p.token_ids + o.token_ids, p.images
        other = every[(i + len(every) // 3) % len(every)].images[0]  # another colour, the same token count
        trajs.append(Trajectory(tokens, n, [(n, n + k)], o.logprobs, [0] * k, images=[im]))
        swapped.append(Trajectory(tokens, n, [(n, n + k)], o.logprobs, [0] * k,
                                  images=[TraceImage(other.data, im.offset, im.length, other.grid)]))  # fmt: skip
    engine = torch.tensor([lp for t in trajs for lp in t.action_logprobs])
    device = "cpu" if dry else "cuda"
    kind = "builtin engine (dry run)" if dry else "vLLM 0.26 (bf16)"
    note = f"{len(trajs)} samples x {NEW} tokens; {media} with a generated vision token left out"
    bf16 = trainer_logprobs(model_dir, trajs, vision, "bfloat16", device, pack=True)
    effect = (bf16 - trainer_logprobs(model_dir, swapped, vision, "bfloat16", device, pack=True)).abs()
    write_row(out, bench="vlm", case="trainer bf16: the same tokens with another image (the image's effect)",
              value=float(effect.mean()), unit="mean abs Δ logp", note=f"max {float(effect.max()):.2e}")  # fmt: skip
    gaps = {}
    fp32 = trainer_logprobs(model_dir, trajs, vision, "float32", device, pack=True)
    padded = trainer_logprobs(model_dir, trajs, vision, "bfloat16", device, pack=False)
    for name, trainer in (("bf16, packed rows", bf16), ("bf16, padded rows", padded), ("fp32", fp32)):
        gap = (engine - trainer).abs()
        gaps[name] = float(gap.mean())
        write_row(out, bench="vlm", case=f"{kind} vs trainer {name}, tiny-vl, 1 image/prompt",
                  value=float(gap.mean()), unit="mean abs Δ logp", baseline=float(effect.mean()),
                  ratio=float(gap.mean() / effect.mean()), note=f"max {float(gap.max()):.2e}; {note}")  # fmt: skip
    return {"effect": float(effect.mean()), **gaps}


def train(tmp: Path, out: Path | None, dry: bool) -> list[dict]:
    """A short `molt-hpc run` of the colour task on the engine; returns the actor's metrics records."""
    from molt_hpc.log import read_metrics

    steps = 2 if dry else TRAIN_STEPS
    sets = [*engine_sets(dry), f"run.root={tmp}", "run.name=train", f"run.steps={steps}", "logging.progress=lines",
            "engines.gpu_memory_utilization=0.3" if not dry else "engines.threads=1"]  # fmt: skip
    cmd = [str(Path(sys.executable).parent / "molt-hpc"), "run", str(CONFIG)] + [a for s in sets for a in ("--set", s)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900, env=gpu_env())
    actor = read_metrics(tmp / "train" / "metrics.jsonl", source="actor")
    if proc.returncode != 0 or len(actor) != steps:
        print(proc.stdout[-3000:], proc.stderr[-3000:])
        raise SystemExit(f"the run ended with {proc.returncode} after {len(actor)} of {steps} steps")
    kl = [r["kl_rollout"] for r in actor]
    write_row(out, bench="vlm", case=f"train on {'builtin' if dry else 'vLLM'} rollouts, {steps} steps",
              value=max(kl), unit="max kl_rollout", note=f"kl_rollout per step {[round(k, 4) for k in kl]}; "
              f"reward {actor[0]['reward']:.3f} -> {actor[-1]['reward']:.3f}")  # fmt: skip
    return actor


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--dry-run", action="store_true", help="the builtin engine on the CPU in vLLM's place")
    ap.add_argument("--only", choices=["check", "train"], default=None)
    args = ap.parse_args()
    dry = args.dry_run
    if not dry and (not torch.cuda.is_available() or importlib.util.find_spec("vllm") is None):
        print("gpu_vlm: needs a CUDA GPU and vLLM (pip install 'molt-hpc[gpu]'); nothing measured")
        return 0
    tmp = Path(tempfile.mkdtemp(prefix="bench-gpu-vlm-"))
    if args.only in (None, "check"):
        check(tmp, args.out, dry)
    if args.only in (None, "train"):
        train(tmp, args.out, dry)
    return 0


if __name__ == "__main__":
    sys.exit(main())
