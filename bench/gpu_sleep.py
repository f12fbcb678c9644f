"""vLLM's sleep mode on one GPU: what sleeping the engine through the train step frees, and what it costs.

With both pools on one GPU the engine holds `engines.gpu_memory_utilization` of it (weights + KV cache)
while the trainer steps. vLLM 0.26 can give that memory back (`enable_sleep_mode`): level 1 copies the
weights to host memory and drops the KV cache, level 2 drops both (the next refit writes every weight
anyway). Per shape (Qwen2 0.5B and 7B, random bf16 weights written once), one `vllm.LLM` at
gpu_memory_utilization 0.3, rows:

- the device memory a sleep frees (free memory after − before, GiB) against what the engine holds;
- the seconds of `sleep` + `wake_up`, against one rollout batch of the same engine in the same run
  (64 prompts of 128 tokens, 128 new tokens each): the time the engine would stop generating for;
- level 1: the greedy answers after waking equal those before; level 2: they do after the weights are
  loaded again from the same files (what a refit does).

    python bench/gpu_sleep.py [--out rows.jsonl] [--shapes 0.5b 7b]
"""

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # the reload below is a function sent to the worker
import torch
from gpu_common import build_model, write_row

N, PROMPT_LEN, NEW = 64, 128, 128
GIB = 1 << 30


def reload_weights(worker, model_dir: str) -> int:
    """On the worker: load every weight of `model_dir` into the model again (what a refit does)."""
    from safetensors.torch import load_file

    n = 0
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        weights = load_file(f, device="cuda")
        worker.model_runner.model.load_weights(weights.items())
        n += len(weights)
    return n


def answers(llm, prompts, sp) -> tuple[list[list[int]], float]:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], time.perf_counter() - t0


def free_gib() -> float:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0] / GIB


def one_shape(shape: str, out: Path | None, tmp: Path) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    model_dir = tmp / shape
    model = build_model(shape, torch.bfloat16, "cuda", seed=0)
    model.save_pretrained(model_dir, safe_serialization=True)
    weights_gib = sum(p.numel() * 2 for p in model.parameters()) / GIB
    del model
    torch.cuda.empty_cache()
    rng = random.Random(0)
    prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(100, 30000) for _ in range(PROMPT_LEN)]) for _ in range(N)]
    llm = LLM(str(model_dir), skip_tokenizer_init=True, gpu_memory_utilization=0.3, max_model_len=1024,
              max_num_seqs=N, seed=0, generation_config="vllm", enable_sleep_mode=True)  # fmt: skip
    sp = SamplingParams(max_tokens=NEW, ignore_eos=True, temperature=0.0, detokenize=False)
    answers(llm, prompts, sp)  # warm-up
    before, batch_s = answers(llm, prompts, sp)
    held = torch.cuda.mem_get_info()[1] / GIB * 0.3
    for level in (1, 2):
        awake = free_gib()
        t0 = time.perf_counter()
        llm.sleep(level=level)
        sleep_s = time.perf_counter() - t0
        asleep = free_gib()
        t0 = time.perf_counter()
        llm.wake_up()
        wake_s = time.perf_counter() - t0
        note = f"weights {weights_gib:.2f} GiB; free {awake:.1f} -> {asleep:.1f} GiB asleep"
        if level == 2:
            t0 = time.perf_counter()
            llm.collective_rpc(reload_weights, args=(str(model_dir),))
            note += f"; weights loaded again from the files in {time.perf_counter() - t0:.2f} s"
        after, _ = answers(llm, prompts, sp)
        same = sum(a == b for a, b in zip(after, before, strict=True))
        write_row(out, bench="sleep", case=f"{shape} level {level}: memory freed", value=round(asleep - awake, 2),
                  unit="GiB", baseline=round(held, 2), ratio=round((asleep - awake) / held, 3),
                  note=f"baseline: the engine's share (0.3 of the GPU); {note}")  # fmt: skip
        write_row(out, bench="sleep", case=f"{shape} level {level}: sleep + wake_up", value=round(sleep_s + wake_s, 3),
                  unit="s", baseline=round(batch_s, 3), ratio=round((sleep_s + wake_s) / batch_s, 3),
                  note=f"baseline: one rollout batch ({N}x{NEW} new tokens); sleep {sleep_s:.3f} s, wake "
                  f"{wake_s:.3f} s; greedy answers equal to before: {same} of {N}")  # fmt: skip
    del llm


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--shapes", nargs="+", default=["0.5b", "7b"])
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes:
            one_shape(shape, args.out, Path(tmp))
    return 0


if __name__ == "__main__":
    sys.exit(main())
