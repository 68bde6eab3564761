#!/usr/bin/env bash
# tp 2 with sequence parallel, two builds alternated, twice: bench-small as
# bench/tp_scaling.sh runs it (global batch 8 x 256, micro-batch 4, steps
# 4-13, 2 ranks x 1 thread). Prints tokens/s, the tensor group's calls and
# bytes a step and the time in them, and the final loss.
#   bench/sp_norms.sh BEFORE_BUILD_DIR [AFTER_BUILD_DIR (default build)]
# (2026-12-07: before = d26bb58, each block's norms summed over the tensor
# group every micro-batch; after = the step's one sum, issue 35.)
set -euo pipefail
cd "$(dirname "$0")/.."
BEFORE="${1:?usage: bench/sp_norms.sh BEFORE_BUILD_DIR [AFTER_BUILD_DIR]}"; AFTER="${2:-build}"
OUT=$(mktemp -d /tmp/spb.XXXXXX)
/usr/bin/python3 bench/random_tokens.py "$OUT/tokens.bin"
common=(-c configs/bench-small.toml --set data.train="$OUT/tokens.bin" --set train.steps=13
        --set train.micro_batch_size=4 --set train.checkpoint_interval=0 --set train.threads=1
        --set parallel.tp=2 --set parallel.sequence_parallel=true --nproc 2)
echo "== $(lscpu | sed -n 's/^Model name: *//p'), load $(cut -d' ' -f1-3 /proc/loadavg)"
for round in 1 2; do
  for which in before after; do
    BIN="$BEFORE/pagedoptim"; [ $which = after ] && BIN="$AFTER/pagedoptim"
    $BIN train "${common[@]}" --set run.dir="$OUT/${which}_$round" > "$OUT/${which}_$round.log" 2>&1
    /usr/bin/python3 - "$OUT/${which}_$round" $which $round <<'PY'
import json, sys
recs = [json.loads(l) for l in open(sys.argv[1] + "/metrics.jsonl") if '"loss"' in l][3:]
t = sum(r["step_ms"] for r in recs) / 1000
tok = sum(r["tokens_per_s"] * r["step_ms"] / 1000 for r in recs)
tp = recs[-1].get("tp_comm", {})
calls = sum(v["calls"] for v in tp.values()); mib = sum(v["bytes"] for v in tp.values()) / 2**20
ms = sum(r.get("tp_comm_ms", 0) for r in recs) / len(recs)
print(f"{sys.argv[2]:6s} round {sys.argv[3]}: {tok / t:7.1f} tokens/s, tp {calls} calls {mib:.1f} MiB per step, "
      f"{ms:.1f} ms in them, final loss {recs[-1]['loss']:.4f}")
PY
  done
done
rm -rf "$OUT"
