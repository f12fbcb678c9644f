"""The GPU benchmarks in one table (`make bench-gpu`): engine tokens/s, refit time, trainer step MFU,
packed against padded trainer steps, the cost of trainer offload.

Runs `bench/gpu_engine.py`, `bench/gpu_rollout.py` (the built-in engine under the SmolLM2 recipe's
rollout load), `bench/gpu_refit.py`, `bench/gpu_train.py` (under torchrun, two ranks),
`bench/gpu_pack.py` (one GPU), `bench/gpu_vllm.py` (vLLM next to the built-in engine), `bench/gpu_vllm_one.py`
(vLLM direct, through our front and our engine on one GPU), `bench/gpu_offload.py` (one GPU),
`bench/gpu_moe.py` (MoE router replay through vLLM on one GPU) and `bench/gpu_vlm.py` (vLLM serving the
tiny vision-language model on one GPU; the vLLM ones skipped without vLLM) one after the other (and,
asked for with `--only ep`, `bench/gpu_ep.py` on every GPU of a 4- or 8-GPU host: expert parallelism
against FSDP alone), each in its own processes with a time limit, collects their rows and prints one
Markdown table: what was measured, the baseline measured in the same run, their ratio and the target.
Made for two CUDA GPUs; on one, the trainer runs as a world of one and the refit goes through CUDA IPC
only (the NCCL refit needs two; see `gpu_refit.py`). `--dry-run` runs the same scripts on the CPU with
tiny shapes (a script check, not a measurement). Each benchmark's full output goes to `--logs`.

    python bench/gpu.py [--only engine rollout refit train pack vllm vllm1 offload moe vlm ep] [--speed] [--logs DIR]
                         [--dry-run]
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
LIMIT_S = {
    "engine": 180,
    "rollout": 240,
    "refit": 300,
    "train": 240,
    "pack": 240,
    "vllm": 420,
    "vllm1": 300,
    "offload": 150,
    "moe": 300,
    "vlm": 480,
    "ep": 600,
}
SPEED = ["train", "engine", "rollout", "vllm1"]
"""`--speed`: the trainer at the 0.5B shape (step, host breakdown, loss kernels), the engine's decode
variants, the engine under the SmolLM2 recipe's rollout load and vLLM on one GPU: about seven minutes on
one H200."""


def command(name: str, out: Path, dry: bool, gpus: int, shapes: list[str] | None = None) -> list[str]:
    script = str(BENCH / f"gpu_{'vllm_one' if name == 'vllm1' else name}.py")
    args = ["--out", str(out)] + (["--dry-run"] if dry else [])
    if name in ("train", "ep"):  # ep: every GPU of the host (made for 4 or 8)
        args += ["--shapes", *shapes] if shapes and name == "train" else []
        local = Path(sys.executable).parent / "torchrun"
        torchrun = str(local) if local.exists() else shutil.which("torchrun") or "torchrun"
        ranks = 2 if dry else (min(2, gpus) if name == "train" else max(gpus, 1))
        return [torchrun, "--nproc-per-node", str(ranks), script, *args]
    return [sys.executable, script, *args]


def fmt(value) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 1:
        return f"{value:.2f}"
    return f"{value:.2e}" if value else "0"


def table(rows: list[dict]) -> str:
    head = "| bench | case | measured | unit | baseline (same run) | ratio | target | note |"
    lines = [head, "|---|---|---:|---|---:|---:|---|---|"]
    for r in rows:
        ratio = f"{r['ratio']:.2f}x" if r.get("ratio") is not None else ""
        cells = [r["bench"], r["case"], fmt(r["value"]), r["unit"], fmt(r.get("baseline")), ratio,
                 r.get("target") or "", r.get("note") or ""]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--only",
        nargs="+",
        choices=sorted(LIMIT_S),
        default=["engine", "rollout", "refit", "train", "pack", "vllm", "vllm1", "offload", "moe", "vlm"],
    )
    ap.add_argument("--logs", type=Path, default=None, help="where each benchmark's output goes (default: a temp dir)")
    ap.add_argument("--speed", action="store_true", help=f"only {' '.join(SPEED)}, the trainer at the 0.5B shape")
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args()
    shapes = ["0.5b"] if args.speed else None
    if args.speed:
        args.only = SPEED
    logs = args.logs or Path(tempfile.mkdtemp(prefix="bench-gpu-"))
    logs.mkdir(parents=True, exist_ok=True)
    out = logs / "rows.jsonl"
    out.unlink(missing_ok=True)
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "PYTHONUNBUFFERED": "1"}
    import torch

    gpus = torch.cuda.device_count()
    print(f"== {gpus} GPU(s): {torch.cuda.get_device_name(0) if gpus else 'none'}", flush=True)
    failed = []
    for name in args.only:
        t0 = time.perf_counter()
        with open(logs / f"{name}.log", "wb") as log:
            try:
                cmd = command(name, out, args.dry_run, gpus, shapes)
                code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                      timeout=LIMIT_S[name]).returncode  # fmt: skip
            except subprocess.TimeoutExpired:
                code = "timeout"
        print(f"== {name}: exit {code} in {time.perf_counter() - t0:.0f} s (log {logs / f'{name}.log'})", flush=True)
        if code != 0:
            failed.append(name)
            print((logs / f"{name}.log").read_text(errors="replace")[-3000:])
    rows = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    print(table(rows))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
