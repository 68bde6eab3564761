#!/usr/bin/env bash
# ZeRO stages side by side: bench-small, dp = 2 ranks x 1 thread, the same
# global batch (8 x 256), parallel.zero_stage = 0, 1, 2, 3 in the same run.
# Prints tokens/s of each stage, its ratio to stage 0 (target for stage 3:
# >= 0.9, the gathers hidden behind compute) and the exposed communication
# wait per step (comm_wait_ms: what the step waited for after the backward),
# plus every rank's model-state bytes from metrics.jsonl (memory_per_rank).
#   bench/zero_speed.sh [--steps N] [--build DIR] [--stages "0 1 2 3"]
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=8; BUILD=build; STAGES="0 1 2 3"
while [ $# -gt 0 ]; do
  case "$1" in
    --steps) STEPS="$2"; shift 2 ;;
    --build) BUILD="$2"; shift 2 ;;
    --stages) STAGES="$2"; shift 2 ;;
    *) echo "zero_speed.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
done
BIN="$BUILD/pagedoptim"
[ -x "$BIN" ] || { echo "zero_speed.sh: $BIN not found; run scripts/setup first" >&2; exit 1; }
OUT=$(mktemp -d /tmp/po_zero_speed.XXXXXX)
trap 'rm -rf "$OUT"' EXIT
/usr/bin/python3 bench/random_tokens.py "$OUT/tokens.bin"
for s in $STAGES; do
  env -u OPENBLAS_CORETYPE "$BIN" train -c configs/bench-small.toml --set data.train="$OUT/tokens.bin" \
    --set train.steps="$STEPS" --set train.micro_batch_size=4 --set train.checkpoint_interval=0 \
    --set train.threads=1 --set parallel.zero_stage="$s" --set run.dir="$OUT/s$s" --nproc 2 \
    > "$OUT/s$s.log" 2>&1 || { echo "stage $s failed:"; tail -5 "$OUT/s$s.log"; exit 1; }
done
/usr/bin/python3 - "$OUT" $STAGES <<'PY'
import json, sys
out, stages = sys.argv[1], sys.argv[2:]
def stats(run):
    recs = [json.loads(l) for l in open(f"{out}/{run}/metrics.jsonl") if '"loss"' in l][2:]
    t = sum(r["step_ms"] for r in recs) / 1000
    tok = sum(r["tokens_per_s"] * r["step_ms"] / 1000 for r in recs)
    wait = sum(r.get("comm_wait_ms", 0) for r in recs) / len(recs)
    mem = recs[-1]["memory_per_rank"]
    return tok / t, wait, sum(r["step_ms"] for r in recs) / len(recs), mem
rows = {s: stats(f"s{s}") for s in stages}
base = rows[stages[0]][0]
print(f"bench-small B=8 T=256, dp=2 x 1 thread, steps after the first 2")
print("stage  tokens/s  vs stage0  step ms  exposed comm ms  params MiB  grads MiB  adam MiB  gathered MiB  total MiB (rank 0)")
res = []
for s in stages:
    tps, w, step, mem = rows[s]
    m = mem[0]
    mib = lambda k: m[k] / 2**20
    print(f"{s:>5}  {tps:8.1f}  {tps/base:9.3f}  {step:7.0f}  {w:15.1f}  {mib('params'):10.1f}  {mib('grads'):9.1f}"
          f"  {mib('adam'):8.1f}  {mib('gathered'):12.1f}  {mib('total'):9.1f}")
    res.append({"stage": int(s), "tokens_per_s": tps, "ratio": tps / base, "exposed_comm_ms": w,
                "memory_rank0": m})
if "3" in stages and stages[0] == "0":
    r = rows["3"][0] / base
    print(f"stage 3 / stage 0: {r:.3f}   (target >= 0.9: {'PASS' if r >= 0.9 else 'FAIL'})")
print(json.dumps({"bench": "zero_speed", "rows": res}))
PY
