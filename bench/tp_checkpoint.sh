#!/usr/bin/env bash
# The time a synchronous checkpoint holds a tensor-parallel run: bench-small
# at tp 2 (2 processes x 1 thread), 8 steps, a save every 2 (parameters,
# Adam m and v: 360 MB), checkpoint_ms of each save from metrics.jsonl. Run it
# with two builds (--build) to compare them; it prints the saves, their
# median and the median step.
#   bench/tp_checkpoint.sh [--build DIR] [--tp N]
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=build; TP=2
while [ $# -gt 0 ]; do
  case "$1" in
    --build) BUILD="$2"; shift 2 ;;
    --tp) TP="$2"; shift 2 ;;
    *) echo "tp_checkpoint.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
done
BIN="$BUILD/pagedoptim"
[ -x "$BIN" ] || { echo "tp_checkpoint.sh: $BIN not found; run scripts/setup first" >&2; exit 1; }
OUT=$(mktemp -d /tmp/po_tp_checkpoint.XXXXXX)
trap 'rm -rf "$OUT"' EXIT
echo "== tp_checkpoint: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) CPUs, tp $TP, $BIN"
/usr/bin/python3 bench/random_tokens.py "$OUT/tokens.bin"
env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE "$BIN" train -c configs/bench-small.toml \
  --set data.train="$OUT/tokens.bin" --set train.steps=8 --set train.micro_batch_size=4 \
  --set train.checkpoint_interval=2 --set checkpoint.keep=1 --set parallel.tp="$TP" \
  --set train.threads=1 --nproc "$TP" --set run.dir="$OUT/run" > "$OUT/run.log" 2>&1 ||
  { echo "tp_checkpoint.sh: the run failed:"; tail -5 "$OUT/run.log"; exit 1; }
/usr/bin/python3 - "$OUT/run" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1] + "/metrics.jsonl") if '"loss"' in l]
saves = [r["checkpoint_ms"] for r in rows if r["step"] % 2 == 0]
steps = [r["step_ms"] for r in rows[2:]]
print(f"saves {', '.join(f'{s:.0f}' for s in saves)} ms, median {statistics.median(saves):.0f} ms; "
      f"median step {statistics.median(steps):.0f} ms")
PY
