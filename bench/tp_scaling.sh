#!/usr/bin/env bash
# Tensor-parallel scaling on one machine: bench-small, the same global batch
# (8 x 256, micro-batch 4), runs one after another:
#   dp=1 x 2 threads | dp=2 (2 ranks x 1 thread) | tp=2 | tp=2 + sequence
#   parallel | each tp run again with parallel.tp_overlap (2 ranks x 1 thread)
# Prints tokens/s of each, tp=2 against dp=2 (target >= 0.85), the tensor
# group's communication per step from metrics.jsonl: calls and bytes
# (tp_comm), the time in them when they block (tp_comm_ms of the blocking
# run: all of it exposed, the total) and what stays exposed with overlap;
# and the activations one layer saves (the engine's own count, from the log)
# at tp 2 with and without sequence parallel against Korthikanti et al.'s
# formula (flash form, no dropout masks: 16sbh/t with SP, sbh(4 + 12/t)
# without, fp32), with the share SP saves (target: the formula's within 10%).
#   bench/tp_scaling.sh [--steps N] [--build DIR]
NAME=tp_scaling.sh
source "$(dirname "$0")/scaling_runs.sh"
run dp1 --set train.threads=2
run dp2 --set train.threads=1 --nproc 2
tp=(--set train.threads=1 --set parallel.tp=2 --nproc 2)
run tp2 "${tp[@]}"
run tp2_sp "${tp[@]}" --set parallel.sequence_parallel=true
run tp2_ov "${tp[@]}" --set parallel.tp_overlap=true
run tp2_sp_ov "${tp[@]}" --set parallel.sequence_parallel=true --set parallel.tp_overlap=true
/usr/bin/python3 - "$OUT" <<'PY'
import json, re, sys
out = sys.argv[1]
def stats(run):
    recs = [json.loads(l) for l in open(f"{out}/{run}/metrics.jsonl") if '"loss"' in l][3:]
    t = sum(r["step_ms"] for r in recs) / 1000
    tok = sum(r["tokens_per_s"] * r["step_ms"] / 1000 for r in recs)
    n = len(recs)
    avg = lambda f: sum(f(r) for r in recs) / n
    tp = recs[-1].get("tp_comm", {})
    log = open(f"{out}/{run}.log").read()
    layer = re.search(r"activations saved per layer: (\d+) bytes", log)
    shape = re.search(r"model (\d+)L/(\d+)C/", log)
    return {"tokens_per_s": tok / t, "step_ms": avg(lambda r: r["step_ms"]),
            "exposed_dp_ms": avg(lambda r: r.get("exposed_comm_ms", 0)),
            "tp_ms": avg(lambda r: r.get("tp_comm_ms", 0)),
            "tp_calls": sum(v["calls"] for v in tp.values()),
            "tp_mib": sum(v["bytes"] for v in tp.values()) / 2**20,
            "layer_bytes": int(layer.group(1)) if layer else 0,
            "C": int(shape.group(2)), "loss": recs[-1]["loss"]}
runs = {k: stats(k) for k in ("dp1", "dp2", "tp2", "tp2_sp", "tp2_ov", "tp2_sp_ov")}
names = {"dp1": "dp=1 x 2 threads", "dp2": "dp=2 x 1 thread", "tp2": "tp=2",
         "tp2_sp": "tp=2 + SP", "tp2_ov": "tp=2, overlap", "tp2_sp_ov": "tp=2 + SP, overlap"}
print("bench-small B=8 T=256 (micro-batch 4), steps after the first 3")
for k, s in runs.items():
    print(f"  {names[k]:19s}: {s['tokens_per_s']:8.1f} tokens/s  ({s['step_ms']:.0f} ms/step, "
          f"exposed dp comm {s['exposed_dp_ms']:.1f} ms, loss {s['loss']:.4f})")
for k, ov in (("tp2", "tp2_ov"), ("tp2_sp", "tp2_sp_ov")):
    c, o = runs[k], runs[ov]
    print(f"  {names[k]} communication: {c['tp_calls']} collectives, {c['tp_mib']:.1f} MiB per step; "
          f"total {c['tp_ms']:.1f} ms ({100 * c['tp_ms'] / c['step_ms']:.1f}% of the step, blocking), "
          f"exposed with overlap {o['tp_ms']:.1f} ms; overlap {o['tokens_per_s'] / c['tokens_per_s']:.3f}x")
b = runs["dp2"]["tokens_per_s"]
best = max(runs[k]["tokens_per_s"] for k in ("tp2", "tp2_ov"))
r = runs["tp2"]["tokens_per_s"] / b
print(f"  ratio tp2/dp2     : {r:.3f}   (target >= 0.85: {'PASS' if r >= 0.85 else 'FAIL'})")
s_, b_, h, t = 256, 4, runs["tp2"]["C"], 2
f_tp, f_sp = 4 * s_ * b_ * h * (4 + 12 / t), 4 * 16 * s_ * b_ * h / t
e_tp, e_sp = runs["tp2"]["layer_bytes"], runs["tp2_sp"]["layer_bytes"]
saved, want = 1 - e_sp / e_tp, 1 - f_sp / f_tp
print(f"  activations per layer at tp 2: {e_tp / 2**20:.3f} MiB (formula {f_tp / 2**20:.3f}), "
      f"with SP {e_sp / 2**20:.3f} MiB (formula {f_sp / 2**20:.3f})")
ok = abs(saved / want - 1) <= 0.10
print(f"  SP saves {100 * saved:.1f}% of a layer's activations, the formula {100 * want:.1f}% "
      f"(target within 10%: {'PASS' if ok else 'FAIL'})")
print(json.dumps({"bench": "tp_scaling", **{f"{k}_tokens_per_s": v["tokens_per_s"] for k, v in runs.items()},
                  "ratio_tp2_dp2": r, "tp2_comm_ms": runs["tp2"]["tp_ms"],
                  "tp2_overlap_exposed_ms": runs["tp2_ov"]["tp_ms"],
                  "tp2_sp_comm_ms": runs["tp2_sp"]["tp_ms"],
                  "tp2_sp_overlap_exposed_ms": runs["tp2_sp_ov"]["tp_ms"],
                  "tp2_comm_mib": runs["tp2"]["tp_mib"], "tp2_sp_comm_mib": runs["tp2_sp"]["tp_mib"],
                  "layer_bytes_tp2": e_tp, "layer_bytes_tp2_sp": e_sp,
                  "formula_tp2": f_tp, "formula_tp2_sp": f_sp, "sp_saved": saved, "sp_saved_formula": want}))
PY
