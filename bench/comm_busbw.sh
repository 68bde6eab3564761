#!/usr/bin/env bash
# Collective bus bandwidth on one machine: this engine's allreduce,
# reduce-scatter and all-gather (f32, sum; bench/comm/comm_bench.cc through
# MpiCommunicator) next to OpenMPI's own MPI_Allreduce / MPI_Reduce_scatter_block
# / MPI_Allgather (bench/comm/ompi_coll.c), in the same run.
#   engine         : no environment tuning (GLIBC_TUNABLES unset), launched as
#                    `pagedoptim train --nproc N` launches its workers
#   openmpi tuned  : GLIBC_TUNABLES=glibc.malloc.hugetlb=1
#   openmpi untuned: GLIBC_TUNABLES unset
# All three use the same mpirun line. For each rank count and size the three
# run back to back, --repeat times, their order rotating, so that noise on a
# shared machine hits them alike (on the 2-core VM of docs/benchmarks.md, memory
# bandwidth itself switches between two levels every few seconds). A figure
# is, per launch, the best timed iteration (the maximum over ranks of each
# iteration), and over the launches, the median (a few disturbed launches do
# not decide); "(median)" is the same ratio from median iterations.
# busbw (nccl-tests): algbw = total buffer bytes / time; allreduce busbw =
# algbw * 2(n-1)/n; reduce-scatter and all-gather busbw = algbw * (n-1)/n.
# Target: engine / tuned >= 0.95 at >= 16 MiB.
#   bench/comm_busbw.sh [--ranks "2 4"] [--sizes "1 16 128"] [--repeat R]
#                       [--build DIR] [--out FILE.jsonl]
set -euo pipefail
cd "$(dirname "$0")/.."
RANKS="2 4"; SIZES="1 16 128"; REPEAT=5; BUILD=build; OUT=""
while [ $# -gt 0 ]; do
  case "$1" in
    --ranks) RANKS="$2"; shift 2 ;;
    --sizes) SIZES="$2"; shift 2 ;;
    --repeat) REPEAT="$2"; shift 2 ;;
    --build) BUILD="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    *) echo "comm_busbw.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
done
for b in comm_bench ompi_coll; do
  [ -x "$BUILD/bench/$b" ] || { echo "comm_busbw.sh: $BUILD/bench/$b not found; build first" >&2; exit 1; }
done
TMP=$(mktemp -d /tmp/po_comm_busbw.XXXXXX)
trap 'rm -rf "$TMP"' EXIT
RESULTS="$TMP/results.jsonl"

# One program at one size under one variant, with the mpirun line of
# `pagedoptim train --nproc N` (src/cli/cli.cc launch_workers); its JSON lines
# are tagged with the variant and the repeat.
run() {
  local variant=$1 np=$2 bin=$3 mib=$4 rep=$5
  local envs=(env -u GLIBC_TUNABLES)
  [ "$variant" = tuned ] && envs+=(GLIBC_TUNABLES=glibc.malloc.hugetlb=1)
  local args=(-np "$np" --bind-to none)
  [ "$(id -u)" = 0 ] && args+=(--allow-run-as-root)
  [ "$np" -gt "$(nproc)" ] && args+=(--oversubscribe --mca mpi_yield_when_idle 1)
  "${envs[@]}" mpirun "${args[@]}" "$BUILD/bench/$bin" --sizes "$mib" \
    | sed "s/\"glibc_tunables\": \"[^\"]*\"/\"variant\": \"$variant\", \"repeat\": $rep/" >> "$RESULTS"
}

HEADER="$(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) cores, load average at the start $(cut -d' ' -f1-3 /proc/loadavg)"
echo "# $HEADER" >&2
for np in $RANKS; do
  for mib in $SIZES; do
    for rep in $(seq "$REPEAT"); do
      echo "# ranks $np, $mib MiB, repeat $rep" >&2
      variants=(engine tuned untuned)
      for i in 0 1 2; do
        v=${variants[$(( (i + rep) % 3 ))]}
        if [ "$v" = engine ]; then run engine "$np" comm_bench "$mib" "$rep"
        else run "$v" "$np" ompi_coll "$mib" "$rep"; fi
      done
    done
  done
done
[ -n "$OUT" ] && cp "$RESULTS" "$OUT"

/usr/bin/python3 - "$RESULTS" "$HEADER" "$REPEAT" <<'PY'
import json, sys
from collections import defaultdict
print(f"{sys.argv[2]}; {sys.argv[3]} launches per figure")
runs = defaultdict(list)
for line in open(sys.argv[1]):
    r = json.loads(line)
    runs[(r["op"], r["bytes"], r["ranks"], r["variant"])].append(r)

def busbw(rs, key):
    # busbw of each launch's best (or median) iteration; the median launch.
    per_launch = sorted(r["busbw_gbs"] * r["median_ms"] / r[key] for r in rs)
    k = len(per_launch)
    return per_launch[k // 2] if k % 2 else 0.5 * (per_launch[k // 2 - 1] + per_launch[k // 2])

summary = []
print(f"{'op':<15} {'MiB':>4} {'ranks':>5} {'engine':>9} {'tuned':>9} {'untuned':>9} {'eng/tuned':>9} {'(median)':>9}")
print(f"{'':<15} {'':>4} {'':>5} {'GB/s':>9} {'GB/s':>9} {'GB/s':>9} {'':>9} {'':>9}")
keys = sorted({k[:3] for k in runs}, key=lambda k: (k[2], k[1], ["allreduce", "reduce_scatter", "all_gather"].index(k[0])))
for op, nbytes, n in keys:
    got = {v: runs.get((op, nbytes, n, v)) for v in ("engine", "tuned", "untuned")}
    if not all(got.values()):
        continue
    best = {v: busbw(rs, "best_ms") for v, rs in got.items()}
    med = {v: busbw(rs, "median_ms") for v, rs in got.items()}
    ratio, ratio_med = best["engine"] / best["tuned"], med["engine"] / med["tuned"]
    mib = nbytes / 2**20
    flag = "" if mib < 16 else ("  ok" if ratio >= 0.95 else "  BELOW 0.95")
    print(f"{op:<15} {mib:>4.0f} {n:>5} {best['engine']:>9.2f} {best['tuned']:>9.2f} "
          f"{best['untuned']:>9.2f} {ratio:>9.2f} {ratio_med:>9.2f}{flag}")
    summary.append({"op": op, "bytes": nbytes, "ranks": n, "engine_busbw_gbs": best["engine"],
                    "tuned_busbw_gbs": best["tuned"], "untuned_busbw_gbs": best["untuned"],
                    "ratio": ratio, "ratio_median": ratio_med})
big = [s for s in summary if s["bytes"] >= 16 << 20]
if big:
    worst = min(big, key=lambda s: s["ratio"])
    print(f"worst engine/tuned at >= 16 MiB: {worst['ratio']:.2f} ({worst['op']}, "
          f"{worst['bytes'] >> 20} MiB, {worst['ranks']} ranks)   "
          f"(target >= 0.95: {'PASS' if worst['ratio'] >= 0.95 else 'FAIL'})")
print(json.dumps({"bench": "comm_busbw", "rows": summary}))
PY
