#!/usr/bin/env bash
# The planner's step time against the engine's, in the same run on this
# machine: for each layout, `pagedoptim plan --json` (cluster "local", peaks
# measured now) and `pagedoptim train` on the same config; prints predicted
# and measured tokens/s (steps 2..N) and their ratio, and the predicted and
# measured compute-pool peak.
#   bench/plan_speed.sh [--build DIR] [--steps N] [--config CFG]
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=build; STEPS=5; CONFIG=configs/bench-small.toml
while [ $# -gt 0 ]; do
  case "$1" in
    --build) BUILD="$2"; shift 2 ;;
    --steps) STEPS="$2"; shift 2 ;;
    --config) CONFIG="$2"; shift 2 ;;
    *) echo "plan_speed.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
done
BIN="$BUILD/pagedoptim"
[ -x "$BIN" ] || { echo "plan_speed.sh: $BIN not found; run scripts/setup first" >&2; exit 1; }
OUT=$(mktemp -d /tmp/po_plan_speed.XXXXXX)
trap 'rm -rf "$OUT"' EXIT
/usr/bin/python3 bench/random_tokens.py "$OUT/tokens.bin" 300000

# name | ranks | --set overrides
LAYOUTS=(
  "dp1-2threads|1|train.threads=2 train.micro_batch_size=8"
  "dp2-1thread|2|train.threads=1 train.micro_batch_size=4"
  "dp2-zero3|2|train.threads=1 train.micro_batch_size=4 parallel.zero_stage=3"
  "dp1-bf16-ckpt|1|train.threads=2 train.micro_batch_size=8 train.precision=bf16 model.activation_checkpointing=true"
)
for entry in "${LAYOUTS[@]}"; do
  IFS='|' read -r name ranks sets <<< "$entry"
  args=(-c "$CONFIG" --set data.train="$OUT/tokens.bin" --set train.steps="$STEPS")
  for s in $sets; do args+=(--set "$s"); done
  "$BIN" plan "${args[@]}" --set parallel.dp="$ranks" --json > "$OUT/$name.plan.json"
  if [ "$ranks" -gt 1 ]; then launch=(--nproc "$ranks"); else launch=(); fi
  "$BIN" train "${args[@]}" --set run.dir="$OUT/$name" "${launch[@]}" > "$OUT/$name.log" 2>&1 \
    || { echo "$name: training failed"; tail -5 "$OUT/$name.log"; exit 1; }
done

/usr/bin/python3 - "$OUT" "${LAYOUTS[@]}" <<'PY'
import json, sys
out = sys.argv[1]
print(f"{'layout':<16} {'predicted tok/s':>16} {'measured tok/s':>15} {'ratio':>7}   {'pool peak: predicted':>22} {'measured':>12}")
for entry in sys.argv[2:]:
    name = entry.split("|")[0]
    plan = json.load(open(f"{out}/{name}.plan.json"))
    recs = [json.loads(l) for l in open(f"{out}/{name}/metrics.jsonl") if '"tokens_per_s"' in l]
    steps = recs[1:] or recs
    tps = sum(r["tokens_per_s"] for r in steps) / len(steps)
    pred = plan["time"]["tokens_per_s"]
    peak = max(m["peak"] for m in recs[-1]["memory_per_rank"])
    print(f"{name:<16} {pred:>16.0f} {tps:>15.0f} {pred / tps:>7.3f}   {plan['compute_peak_bytes'] / 2**20:>18.1f} MiB {peak / 2**20:>8.1f} MiB")
PY
