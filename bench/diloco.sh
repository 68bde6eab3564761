#!/usr/bin/env bash
# DiLoCo inside one job against synchronous data parallel at equal tokens
# (issue 40; docs/diloco.md): 4 replicas of one rank each, every replica
# train.batch_size sequences a step, H inner AdamW steps per outer Nesterov
# step (lr 0.7, momentum 0.9), against data parallel over 4 ranks at 4x the
# batch, and one worker alone at the replica's batch (the lower bound).
# Prints the final validation loss, the bytes each rank sent as payload
# (DP: its gradient all-reduces; DiLoCo: its outer all-reduces) and their
# ratio to data parallel's. The target: at H = 50 within 2% of data
# parallel's validation loss with >= 40x fewer bytes.
#   bench/diloco.sh [PRESET (gpt2-tiny)] [STEPS (300)] [H values ("1 10 50 100")]
# Needs data/brown (bash scripts/demo prepares it). Not a timed benchmark:
# the numbers are losses and bytes, the same on any CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
PRESET="${1:-gpt2-tiny}"; STEPS="${2:-300}"; HS="${3:-1 10 50 100}"
BIN=build/pagedoptim
OUT=$(mktemp -d /tmp/diloco.XXXXXX)
common=(-c configs/tiny.toml --set model.preset="$PRESET" --set model.seq_len=64 --set train.steps="$STEPS"
        --set train.micro_batch_size=8 --set train.lr=1e-3 --set train.min_lr=1e-4 --set train.warmup_steps=20
        --set train.eval_interval=0 --set train.eval_batches=32 --set train.checkpoint_interval=0
        --set train.threads=1)
echo "== $(lscpu | sed -n 's/^Model name: *//p'); $PRESET, seq 64, $STEPS steps, 8 sequences per replica a step"
run() {  # name, ranks, args...
  local name=$1 ranks=$2; shift 2
  local np=(); [ "$ranks" -gt 1 ] && np=(--nproc "$ranks")
  $BIN train "${common[@]}" --set run.dir="$OUT/$name" "$@" "${np[@]}" > "$OUT/$name.log" 2>&1 ||
    { tail -5 "$OUT/$name.log"; exit 1; }
  /usr/bin/python3 - "$OUT/$name" "$name" "$OUT/dp" <<'PY'
import json, os, sys
def summary(d):
    recs = [json.loads(l) for l in open(d + "/metrics.jsonl")]
    val = [r["val_loss"] for r in recs if "val_loss" in r][-1]
    sent = 0.0
    for r in recs:
        if "outer" in r:
            sent += r["outer"]["bytes"]
        elif "comm" in r:
            sent += r["comm"].get("allreduce", {}).get("bytes", 0)
    return val, sent
val, sent = summary(sys.argv[1])
line = f"{sys.argv[2]:12s} val loss {val:.4f}   bytes/rank {sent / 2**20:10.1f} MiB"
if sys.argv[2] != "dp" and os.path.exists(sys.argv[3] + "/metrics.jsonl"):
    dval, dsent = summary(sys.argv[3])
    line += f"   vs DP: loss {100 * (val / dval - 1):+.2f}%"
    if sent > 0: line += f", {dsent / sent:.0f}x fewer bytes"
print(line, flush=True)
PY
}
run dp 4 --set parallel.dp=4 --set train.batch_size=32
run one_worker 1 --set train.batch_size=8
for H in $HS; do
  run "diloco_H$H" 4 --set parallel.replicas=4 --set train.local_steps="$H" --set train.batch_size=8
done
rm -rf "$OUT"
