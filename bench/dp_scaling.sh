#!/usr/bin/env bash
# Data-parallel scaling on one machine: bench-small, same global batch (8 x 256),
# dp = 2 ranks with 1 thread each (under mpirun) against dp = 1 with 2 threads.
# Prints tokens/s of both, their ratio (target >= 0.9) and the exposed
# communication per step: exposed_comm_ms in metrics.jsonl, how long the
# reductions ran on after the LAST rank finished its backward (the raw wait,
# comm_wait_ms, also holds the wait for a slower rank: imbalance_ms). A third
# run, dp = 2 with parallel.overlap_comm=false (every bucket after the
# backward), measures the communication time itself: then all of it is
# exposed. The target is exposed <= 20% of that.
#   bench/dp_scaling.sh [--steps N] [--build DIR]
NAME=dp_scaling.sh
source "$(dirname "$0")/scaling_runs.sh"
run dp1 --set train.threads=2
run dp2 --set train.threads=1 --nproc 2
run dp2n --set train.threads=1 --set parallel.overlap_comm=false --nproc 2
/usr/bin/python3 - "$OUT" <<'PY'
import json, sys
def stats(run):
    recs = [json.loads(l) for l in open(f"{sys.argv[1]}/{run}/metrics.jsonl") if '"loss"' in l][3:]
    t = sum(r["step_ms"] for r in recs) / 1000
    tok = sum(r["tokens_per_s"] * r["step_ms"] / 1000 for r in recs)
    wait = sum(r.get("exposed_comm_ms", 0) for r in recs) / len(recs)
    imb = sum(r.get("imbalance_ms", 0) for r in recs) / len(recs)
    return tok / t, wait, sum(r["step_ms"] for r in recs) / len(recs), imb
a, _, sa, _ = stats("dp1"); b, w, sb, imb = stats("dp2"); _, c, _, _ = stats("dp2n")
print(f"bench-small B=8 T=256, steps after the first 3")
print(f"  dp=1 x 2 threads : {a:8.1f} tokens/s  ({sa:.0f} ms/step)")
print(f"  dp=2 x 1 thread  : {b:8.1f} tokens/s  ({sb:.0f} ms/step), exposed comm {w:.1f} ms/step ({100*w/sb:.1f}% of the step), rank imbalance {imb:.1f} ms/step")
print(f"  communication    : {c:8.1f} ms/step (dp=2 with overlap_comm=false: nothing hidden)")
print(f"  ratio dp2/dp1    : {b/a:.3f}   (target >= 0.9: {'PASS' if b/a >= 0.9 else 'FAIL'})")
print(f"  exposed / comm   : {w/c:.3f}   (target <= 0.2: {'PASS' if w/c <= 0.2 else 'FAIL'})")
print(json.dumps({"bench": "dp_scaling", "dp1_tokens_per_s": a, "dp2_tokens_per_s": b,
                  "ratio": b / a, "exposed_comm_ms": w, "imbalance_ms": imb, "comm_ms": c,
                  "exposed_fraction": w / c, "dp2_step_ms": sb}))
PY
