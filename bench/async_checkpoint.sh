#!/usr/bin/env bash
# The step-time cost of a checkpoint, synchronous against checkpoint.async =
# true, in one run on this machine: gpt2-124M (fp32, B4 x T256, 1 process x 2
# threads), 16 steps, a checkpoint every 4 (1.49 GB each: parameters and Adam
# m, v). For each mode it prints the median step without a checkpoint, the
# step that checkpoints (its compute + the time checkpointing held it: the
# whole write when synchronous, the copy to host memory when async) and the
# step after it (the background write shares the two cores), as ratios to
# the median step. Target: the step that checkpoints <= 1.1x a normal step.
#   bench/async_checkpoint.sh [--build DIR] [--dir RUNDIR]
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=build; DIR=""
while [ $# -gt 0 ]; do
  case "$1" in
    --build) BUILD="$2"; shift 2 ;;
    --dir) DIR="$2"; shift 2 ;;
    *) echo "async_checkpoint.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
done
BIN="$BUILD/pagedoptim"
[ -x "$BIN" ] || { echo "async_checkpoint.sh: $BIN not found; run scripts/setup first" >&2; exit 1; }
OUT=$(mktemp -d "${DIR:-/tmp}/po_async_ckpt.XXXXXX")
trap 'rm -rf "$OUT"' EXIT
/usr/bin/python3 bench/random_tokens.py "$OUT/tokens.bin" 200000
echo "== async_checkpoint: $(lscpu | sed -n 's/^Model name: *//p' | head -1), $(nproc) CPUs, load average $(cut -d' ' -f1-3 /proc/loadavg)"
echo "   checkpoint directory on $(df -h "$OUT" | awk 'NR==2 {print $1" ("$2")"}')"
for mode in sync async; do
  async=false; [ $mode = async ] && async=true
  "$BIN" train -c configs/gpt2-124M-bench.toml --set data.train="$OUT/tokens.bin" \
    --set run.dir="$OUT/$mode" --set train.steps=16 --set train.checkpoint_interval=4 \
    --set checkpoint.keep=1 --set checkpoint.async=$async > "$OUT/$mode.log" 2>&1 ||
    { cat "$OUT/$mode.log"; exit 1; }
done
/usr/bin/python3 - "$OUT" <<'PY'
import json, statistics, sys, os
out = sys.argv[1]
res = {}
for mode in ("sync", "async"):
    rows = [json.loads(l) for l in open(os.path.join(out, mode, "metrics.jsonl")) if '"loss"' in l]
    by = {r["step"]: r for r in rows}
    ck = [s for s in by if s % 4 == 0 and s < 16]          # checkpoints in the middle of the run
    after = [s + 1 for s in ck]
    normal = [by[s]["step_ms"] for s in by if s > 1 and s not in ck and s not in after and s < 16]
    med = statistics.median(normal)
    ck_total = [by[s]["step_ms"] + by[s]["checkpoint_ms"] for s in ck]
    held = [by[s]["checkpoint_ms"] for s in ck]
    nxt = [by[s]["step_ms"] + by[s].get("checkpoint_ms", 0) for s in after]
    res[mode] = (med, ck_total, nxt)
    print(f"{mode:>5}: median step {med:7.0f} ms | checkpoint steps {', '.join(f'{t:.0f}' for t in ck_total)} ms "
          f"(held {', '.join(f'{h:.0f}' for h in held)} ms) = {statistics.mean(ck_total)/med:.2f}x | "
          f"steps after {', '.join(f'{t:.0f}' for t in nxt)} ms = {statistics.mean(nxt)/med:.2f}x")
med, ck_total, nxt = res["async"]
ratio = statistics.mean(ck_total) / med
smed, sck, _ = res["sync"]
print(f"per checkpoint, time added to the run: sync {statistics.mean(sck) - smed:.0f} ms, "
      f"async {statistics.mean(ck_total) + statistics.mean(nxt) - 2 * med:.0f} ms (copy + the next step's slowdown)")
print(("PASS" if ratio <= 1.1 else "FAIL") + f": async step that checkpoints {ratio:.2f}x a normal step (target <= 1.1)")
PY
