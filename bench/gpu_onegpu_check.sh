#!/usr/bin/env bash
# The one-GPU verification in one command (`make check-onegpu`), meant to finish in under 8 minutes:
#   1. every test marked `gpu` on GPU 0 alone (CUDA_VISIBLE_DEVICES=0): the one-GPU ones run (CUDA IPC
#      refit exactness, the engine's memory share, trainer + engine on one GPU, a short local run, CUDA
#      graphs, vLLM on the trainer's GPU when vLLM is installed); those that need two GPUs say so and skip;
#   2. bench/gpu_refit.py --no-nccl: the refit through CUDA IPC at the 0.5B and 7B shapes against a
#      device copy of the same bytes;
#   3. for each RUN_DIR given, bench/step_split.py: rollout wait / train / refit per step of that run.
# Then one table of everything. Logs and rows stay in $OUT (default: a new /tmp/onegpu-check-* dir).
#
#   bash bench/gpu_onegpu_check.sh [RUN_DIR ...]        PY=python3 to choose the interpreter
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
OUT=${OUT:-$(mktemp -d /tmp/onegpu-check-XXXXXX)}
mkdir -p "$OUT"
export CUDA_VISIBLE_DEVICES=${ONEGPU:-0} NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
t0=$(date +%s)
"$PY" -c "import torch, importlib.util as u; print('==', torch.cuda.get_device_name(0) if torch.cuda.is_available()
else 'no GPU: a check of this script only (GPU tests skip, the bench runs --dry-run)', '| torch', torch.__version__,
'| vLLM', 'yes' if u.find_spec('vllm') else 'not installed (its test skips)')" || exit 1
DRY=$("$PY" -c "import torch; print('' if torch.cuda.is_available() else '--dry-run')")

part() {  # part NAME LIMIT_S CMD...: run CMD with a time limit, log to $OUT/NAME.log, print how it went
  local name=$1 limit=$2 s=$(date +%s); shift 2
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name: exit $rc in $(( $(date +%s) - s )) s (log $OUT/$name.log)"
  [ $rc -eq 0 ] || tail -n 25 "$OUT/$name.log"
  echo "$name $rc $(( $(date +%s) - s ))" >>"$OUT/parts.txt"
}
: >"$OUT/parts.txt"
part tests 330 "$PY" -m pytest -m gpu -q -rA -p no:cacheprovider tests --junitxml="$OUT/tests.xml"
part refit-bench 130 "$PY" bench/gpu_refit.py --no-nccl --out "$OUT/rows.jsonl" $DRY
for run in "$@"; do
  part "split-$(basename "$run")" 30 "$PY" bench/step_split.py "$run" --out "$OUT/rows.jsonl"
done

"$PY" - "$OUT" "$t0" <<'EOF'
import json, sys, time, xml.etree.ElementTree as ET
from pathlib import Path
sys.path.insert(0, "bench")
from gpu import table  # bench/gpu.py's Markdown table

out, t0 = Path(sys.argv[1]), int(sys.argv[2])
rows = []
if (out / "tests.xml").exists():
    for case in ET.parse(out / "tests.xml").iter("testcase"):
        kids = {k.tag: k for k in case}
        outcome = next((t for t in ("failure", "error", "skipped") if t in kids), "passed")
        why = (kids[outcome].get("message") or "")[:90] if outcome != "passed" else ""
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        rows.append({"bench": "test", "case": name, "value": float(case.get("time", 0)), "unit": "s",
                     "note": outcome.upper() + (f": {why}" if why else "")})
if (out / "rows.jsonl").exists():
    rows += [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines() if line.strip()]
parts = [line.split() for line in (out / "parts.txt").read_text().splitlines()]
rows += [{"bench": "part", "case": n, "value": float(s), "unit": "s", "note": f"exit {rc}"} for n, rc, s in parts]
print(table(rows))
took = time.time() - t0
bad = [r["case"] for r in rows if r["bench"] == "test" and r["note"].startswith(("FAILURE", "ERROR"))]
bad += [r["case"] for r in rows if r["bench"] == "part" and r["note"] != "exit 0"]
print(f"\n{len(rows)} rows, {took:.0f} s in all (target < 480 s); {'FAILED: ' + ', '.join(bad) if bad else 'all green'}")
print(f"logs and rows: {out}")
sys.exit(1 if bad else 0)
EOF
