#!/usr/bin/env bash
# Issue 35's migration: pp = 1 through DataParallel (today's path) against
# the pipeline executor's one-stage schedule (PAGEDOPTIM_ONE_STAGE_EXECUTOR=1),
# on the same work: bench-small, global batch 8 x 256 in micro-batches of 4,
# one process with 2 threads and dp = 2 with 1 thread each (ZeRO-0, and
# ZeRO-2 and ZeRO-3: the reduce-scatters and the gathers overlapped). The runs
# alternate (A B A B) so that the VM's drift falls on both. Prints each
# engine's tokens/s (steps after the first 3, both repeats) and the ratio
# executor / DataParallel; the switch to one engine must not fall below
# the machine's spread. With PAGED=1 it adds dp 2 at ZeRO-3 with everything
# paged to NVMe (Adam, the master and the parameter and gradient shards,
# ZeRO-Infinity) behind a one-page host tier, the compute budget the larger
# of the two engines' minimums + 32 pages of 1 MiB.
#   [PAGED=1] bench/one_stage_engines.sh [--steps N] [--build DIR]
NAME=one_stage_engines.sh
source "$(dirname "$0")/scaling_runs.sh"
executor() {  # name, then extra arguments: run through the executor, and check it was
  export PAGEDOPTIM_ONE_STAGE_EXECUTOR=1
  run "$@"
  unset PAGEDOPTIM_ONE_STAGE_EXECUTOR
  grep -q "pipeline: " "$OUT/$1.log" || { echo "$NAME: run $1 did not go through the executor"; exit 1; }
}
layouts="dp1 dp2 dp2z2 dp2z3"
if [ "${PAGED:-0}" = 1 ]; then
  layouts="$layouts dp2z3paged"
  mkdir -p "$OUT/swap"
  paging=(--set memory.nvme_dir="$OUT/swap" --set memory.page_size=1MiB --set memory.host_budget=1MiB)
  least=0
  for e in dataparallel executor; do  # each engine names its minimum for a budget of 1 byte
    [ $e = executor ] && export PAGEDOPTIM_ONE_STAGE_EXECUTOR=1
    n=$("$BIN" train --nproc 2 "${common[@]}" --set run.dir="$OUT/probe_$e" --set train.threads=1 \
          --set parallel.zero_stage=3 "${paging[@]}" --set memory.compute_budget=1 2>&1 |
        sed -n 's/.*at least \([0-9]*\) bytes.*/\1/p' | head -1 || true)  # (the probe fails by design)
    unset PAGEDOPTIM_ONE_STAGE_EXECUTOR
    [ -n "$n" ] || { echo "$NAME: $e named no minimum compute budget"; exit 1; }
    [ "$n" -gt "$least" ] && least=$n
  done
  paging+=(--set memory.compute_budget=$((least + 32 * 1048576)))
fi
for rep in 1 2; do
  run "dp1_dataparallel_$rep" --set train.threads=2
  executor "dp1_executor_$rep" --set train.threads=2
  run "dp2_dataparallel_$rep" --set train.threads=1 --nproc 2
  executor "dp2_executor_$rep" --set train.threads=1 --nproc 2
  for z in 2 3; do
    run "dp2z${z}_dataparallel_$rep" --set train.threads=1 --nproc 2 --set parallel.zero_stage=$z
    executor "dp2z${z}_executor_$rep" --set train.threads=1 --nproc 2 --set parallel.zero_stage=$z
  done
  if [ "${PAGED:-0}" = 1 ]; then
    run "dp2z3paged_dataparallel_$rep" --set train.threads=1 --nproc 2 --set parallel.zero_stage=3 "${paging[@]}"
    executor "dp2z3paged_executor_$rep" --set train.threads=1 --nproc 2 --set parallel.zero_stage=3 "${paging[@]}"
  fi
done
/usr/bin/python3 - "$OUT" $layouts <<'PY'
import json, sys
def rate(run):
    recs = [json.loads(l) for l in open(f"{sys.argv[1]}/{run}/metrics.jsonl") if '"loss"' in l][3:]
    t = sum(r["step_ms"] for r in recs) / 1000
    return sum(r["tokens_per_s"] * r["step_ms"] / 1000 for r in recs) / t
out = {"bench": "one_stage_engines"}
print("bench-small B=8 T=256 (micro-batches of 4), tokens/s of the steps after the first 3")
for layout in sys.argv[2:]:
    r = {e: [rate(f"{layout}_{e}_{k}") for k in (1, 2)] for e in ("dataparallel", "executor")}
    mean = {e: sum(v) / 2 for e, v in r.items()}
    ratio = mean["executor"] / mean["dataparallel"]
    spread = max(abs(r["dataparallel"][0] - r["dataparallel"][1]) / mean["dataparallel"],
                 abs(r["executor"][0] - r["executor"][1]) / mean["executor"])
    print(f"  {layout}: DataParallel {r['dataparallel'][0]:.0f} / {r['dataparallel'][1]:.0f}, "
          f"executor {r['executor'][0]:.0f} / {r['executor'][1]:.0f}; ratio {ratio:.3f} "
          f"(repeat spread {100 * spread:.1f}%)")
    out[layout] = {"dataparallel": r["dataparallel"], "executor": r["executor"], "ratio": ratio, "spread": spread}
print(json.dumps(out))
PY
