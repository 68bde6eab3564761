#!/usr/bin/env bash
# Context-parallel scaling on one machine: llama-mini (4 layers, 256 wide, 4
# query heads sharing 2 kv heads, vocabulary cut to 8192 so that attention is
# a real share of the step) at model.seq_len = 4096 (--seq), a global batch of
# 2 sequences, 2 processes x 1 thread each, runs one after another:
#   dp=2 (cp 1) | cp=2 ring, zigzag | cp=2 ring, contiguous | cp=2 allgather, zigzag
# Prints tokens/s of each and cp 2 against dp 2 per process (target >= 0.85);
# per-rank attention time per step under both balances and how far the
# slowest rank is from the mean (target: zigzag within 10%); the ring's
# exposed communication per layer against the attention's time (target
# under 15%); and the longest sequence whose per-rank memory (the engine's
# ledger from the start-up log: model states and activations, plus the
# ring's buffers) fits a budget, at cp 1 and cp 2 (target >= 1.8x). The
# budget is what cp 1 needs at twice --seq.
#   bench/cp_scaling.sh [--steps N] [--seq T] [--build DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
NAME=cp_scaling.sh
STEPS=5; SEQ=4096; BUILD=build
while [ $# -gt 0 ]; do
  case "$1" in
    --steps) STEPS="$2"; shift 2 ;;
    --seq) SEQ="$2"; shift 2 ;;
    --build) BUILD="$2"; shift 2 ;;
    *) echo "$NAME: unknown argument '$1'" >&2; exit 2 ;;
  esac
done
BIN="$BUILD/pagedoptim"
[ -x "$BIN" ] || { echo "$NAME: $BIN not found; run scripts/setup first" >&2; exit 1; }
OUT=$(mktemp -d /tmp/po_cp_scaling.XXXXXX)
trap 'rm -rf "$OUT"' EXIT
echo "== cp_scaling: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) CPUs, load average $(cut -d' ' -f1-3 /proc/loadavg)"
/usr/bin/python3 bench/random_tokens.py "$OUT/tokens.bin" 1000000 8192
model=(--set model.preset=llama-mini --set model.vocab_size=8192)
common=(-c configs/bench-small.toml "${model[@]}" --set data.train="$OUT/tokens.bin" --set train.batch_size=2
        --set train.micro_batch_size=1 --set train.lr=3e-4 --set train.warmup_steps=0
        --set train.eval_interval=0 --set train.checkpoint_interval=0 --set train.threads=1
        --set parallel.dp=1 --nproc 2)
run() {  # name, then extra arguments
  local name=$1; shift
  "$BIN" train "${common[@]}" --set run.dir="$OUT/$name" --set train.steps="$STEPS" \
    --set model.seq_len="$SEQ" "$@" > "$OUT/$name.log" 2>&1 ||
    { echo "$NAME: run $name failed:"; tail -5 "$OUT/$name.log"; exit 1; }
}
run dp2 --set parallel.dp=2
run cp2_zigzag --set parallel.cp=2
run cp2_contiguous --set parallel.cp=2 --set parallel.cp_balance=contiguous
run cp2_allgather --set parallel.cp=2 --set parallel.cp_mode=allgather

# Per-rank memory at sequence T: the start-up table's total (MiB, rank 0) and
# the ring's buffers, from a run of no steps.
fit() {  # cp, T -> bytes
  local dir="$OUT/fit_$1_$2"
  rm -rf "$dir"
  "$BIN" train "${common[@]}" --set run.dir="$dir" --set train.steps=0 --set model.seq_len="$2" \
    --set parallel.dp=$((2 / $1)) --set parallel.cp="$1" --set train.peak_gflops=1 \
    > "$dir.log" 2>&1 || { echo "$NAME: fit run cp $1 T $2 failed:"; tail -3 "$dir.log"; exit 1; }
  /usr/bin/python3 - "$dir.log" <<'PY'
import re, sys
log = open(sys.argv[1]).read()
line = [l for l in log.splitlines() if re.match(r"^\s+0(\s+[\d.]+){12}$", l)][0].split()
total = float(line[10]) * 2**20
ring = re.search(r"buffers (\d+) bytes per rank", log)
print(int(total + (int(ring.group(1)) if ring else 0)))
PY
}
budget=$(fit 1 $((2 * SEQ)))
longest() {  # cp -> the longest multiple of 1024 (of 2·cp) positions that fits the budget
  local cp=$1 lo=1024 hi=1024
  while [ "$(fit "$cp" "$hi")" -le "$budget" ]; do lo=$hi; hi=$((hi * 2)); done
  while [ $((hi - lo)) -gt 1024 ]; do
    local mid=$(((lo + hi) / 2048 * 1024))
    if [ "$(fit "$cp" "$mid")" -le "$budget" ]; then lo=$mid; else hi=$mid; fi
  done
  echo "$lo"
}
fit1=$(longest 1)
fit2=$(longest 2)

/usr/bin/python3 - "$OUT" "$SEQ" "$budget" "$fit1" "$fit2" <<'PY'
import json, re, sys
out, seq, budget, fit1, fit2 = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
def stats(run):
    recs = [json.loads(l) for l in open(f"{out}/{run}/metrics.jsonl") if '"loss"' in l][1:]
    t = sum(r["step_ms"] for r in recs) / 1000
    tok = sum(r["tokens_per_s"] * r["step_ms"] / 1000 for r in recs)
    n = len(recs)
    att = [sum(r["cp_attention_ms"][k] for r in recs) / n for k in range(2)] if "cp_attention_ms" in recs[0] else []
    exp = [sum(r["cp_exposed_ms"][k] for r in recs) / n for k in range(2)] if "cp_exposed_ms" in recs[0] else []
    return {"tps": tok / t, "step_ms": 1000 * t / n, "att": att, "exp": exp, "loss": recs[-1]["loss"]}
runs = {k: stats(k) for k in ("dp2", "cp2_zigzag", "cp2_contiguous", "cp2_allgather")}
L = 4
print(f"llama-mini (vocab 8192) T={seq}, global batch 2 sequences, 2 processes x 1 thread; steps after the first")
for k, s in runs.items():
    extra = ""
    if s["att"]:
        mean = sum(s["att"]) / 2
        extra = (f"; attention per rank {s['att'][0]:.0f} / {s['att'][1]:.0f} ms (slowest "
                 f"{100 * (max(s['att']) / mean - 1):.1f}% over the mean); exposed cp comm "
                 f"{max(s['exp']) / L:.1f} ms per layer = {100 * max(s['exp']) / max(s['att']):.1f}% of attention")
    print(f"  {k:15s}: {s['tps']:8.1f} tokens/s ({s['step_ms']:.0f} ms/step, loss {s['loss']:.4f}){extra}")
r = runs["cp2_zigzag"]["tps"] / runs["dp2"]["tps"]
print(f"  cp2 (ring, zigzag) / dp2 tokens/s per process: {r:.3f} (target >= 0.85: {'PASS' if r >= 0.85 else 'FAIL'})")
z = runs["cp2_zigzag"]
imb = max(z["att"]) / (sum(z["att"]) / 2) - 1
print(f"  zigzag balance: slowest rank {100 * imb:.1f}% over the mean (target <= 10%: {'PASS' if imb <= 0.10 else 'FAIL'});"
      f" contiguous: {100 * (max(runs['cp2_contiguous']['att']) / (sum(runs['cp2_contiguous']['att']) / 2) - 1):.1f}%")
e = max(z["exp"]) / max(z["att"])
print(f"  ring exposed communication: {100 * e:.1f}% of attention time (target < 15%: {'PASS' if e < 0.15 else 'FAIL'})")
print(f"  longest sequence in {budget / 2**20:.0f} MiB per rank (cp 1's need at T={2 * seq}): cp 1 {fit1}, cp 2 {fit2}"
      f" = {fit2 / fit1:.2f}x (target >= 1.8: {'PASS' if fit2 >= 1.8 * fit1 else 'FAIL'})")
PY
