#!/usr/bin/env bash
# Training throughput: PagedOptim vs PyTorch (fp32, CPU, 2 threads), same machine, same run.
#
#   bench/train_vs_torch.sh [--presets "bench-small gpt2-124M stories42M llama-124M"] [--data FILE.bin]
#                           [--precisions "fp32 bf16"] [--out DIR] [--build DIR] [--torch-only]
#                           [--no-as-given]
#
# Builds nothing: expects build/pagedoptim and build/bench/gemm_bench (cmake --build build).
# For each preset it runs, one after another:
#   engine          build/pagedoptim train -c configs/<preset>.toml, OPENBLAS_CORETYPE and
#                   OPENBLAS_L2_SIZE unset, no other tuning; tokens/s from <run.dir>/metrics.jsonl
#                   (steps after the first 3; total tokens / total time, i.e. the harmonic mean)
#   torch tuned     bench/torch_train.py with OPENBLAS_CORETYPE/OPENBLAS_L2_SIZE unset,
#                   GLIBC_TUNABLES=glibc.malloc.hugetlb=1, OMP_WAIT_POLICY=PASSIVE
#   torch as-given  bench/torch_train.py, environment untouched (skipped with --no-as-given)
# and once build/bench/gemm_bench for the sgemm and bf16 GEMM peaks (2 threads) that MFU is
# measured against. Each precision has its own rows: bf16 runs the engine with
# train.precision = "bf16" and PyTorch (tuned) under torch.autocast("cpu", dtype=torch.bfloat16),
# its MFU against the bf16 GEMM peak (on bf16 operands; the sgemm where there is no native one).
# STEPS (default 13) and WARMUP (default 3) in the environment shorten a run on a busy machine.
# Prints a table per preset and one JSON line per preset; everything is also kept in --out.
# GPT-2 presets use tools/torch_ref/gpt2.py; Llama presets (stories42M, llama-124M) use
# bench/torch_llama.py. Data: random GPT-2 ids (< 50257) unless --data; stories42M keeps its
# real vocabulary (32000) and always trains on its own random ids < 32000.
# Targets: fp32 engine / the faster PyTorch run (tuned or as given) >= 1.3, MFU >= 60% on gpt2-124M and >= 75% on llama-124M,
# peak RSS within 20% of the planner's peak (`pagedoptim plan`, same config); bf16 engine/torch-autocast >= 1.5 on bench-small and
# gpt2-124M, MFU >= 50% of the bf16 peak on gpt2-124M.
# PyTorch is Debian's python3-torch (1.13) under /usr/bin/python3. See docs/benchmarks.md.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY=/usr/bin/python3
PRESETS="bench-small gpt2-124M stories42M llama-124M"
DATA=""
OUT=""
BUILD="$ROOT/build"
TORCH_ONLY=0
AS_GIVEN=1
PRECISIONS="fp32 bf16"
STEPS="${STEPS:-13}"     # 3 warm-up + 10 measured, engine and PyTorch alike
WARMUP="${WARMUP:-3}"
RUN_TIMEOUT="${RUN_TIMEOUT:-2400}"   # seconds per single run

while [[ $# -gt 0 ]]; do
  case "$1" in
    --presets) PRESETS="$2"; shift 2 ;;
    --data) DATA="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    --build) BUILD="$(cd "$2" 2>/dev/null && pwd || echo "$2")"; shift 2 ;;
    --torch-only) TORCH_ONLY=1; shift ;;
    --no-as-given) AS_GIVEN=0; shift ;;
    --precisions) PRECISIONS="$2"; shift 2 ;;
    -h|--help) sed -n '2,25p' "$0"; exit 0 ;;
    *) echo "train_vs_torch.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done

die() { echo "train_vs_torch.sh: error: $*" >&2; exit 1; }

ENGINE="$BUILD/pagedoptim"
GEMM="$BUILD/bench/gemm_bench"
if [[ $TORCH_ONLY -eq 0 ]]; then
  [[ -d "$BUILD" ]] || die "no build directory at $BUILD; build first: cmake -S . -B build -DCMAKE_BUILD_TYPE=Release && cmake --build build -j"
  [[ -x "$ENGINE" ]] || die "$ENGINE not found or not executable; build it first (cmake --build build -j), or pass --torch-only"
fi
[[ -x "$PY" ]] || die "$PY not found (PyTorch comes from Debian's python3-torch)"
"$PY" -c 'import torch' 2>/dev/null || die "$PY cannot import torch (apt-get install python3-torch)"

config_for() {
  case "$1" in
    bench-small) echo "$ROOT/configs/bench-small.toml" ;;
    gpt2-124M) echo "$ROOT/configs/gpt2-124M-bench.toml" ;;
    stories42M) echo "$ROOT/configs/stories42M-bench.toml" ;;
    llama-124M) echo "$ROOT/configs/llama-124M-bench.toml" ;;
    *) die "unknown preset '$1' (bench-small, gpt2-124M, stories42M, llama-124M)" ;;
  esac
}
for p in $PRESETS; do [[ -f "$(config_for "$p")" ]] || die "missing $(config_for "$p")"; done

if [[ -z "$OUT" ]]; then OUT="$(mktemp -d "${TMPDIR:-/tmp}/train_vs_torch.XXXXXX")"; fi
mkdir -p "$OUT" || die "cannot create $OUT"
OUT="$(cd "$OUT" && pwd)"
(( WARMUP >= 0 && STEPS > WARMUP )) || die "STEPS=$STEPS must exceed WARMUP=$WARMUP"
echo "== train_vs_torch: presets [$PRESETS], $STEPS steps ($WARMUP warm-up), engine $ENGINE, results in $OUT"
echo "   $(uname -n), $(nproc) CPUs, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //')"
echo "   environment as given: OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE-<unset>} OPENBLAS_L2_SIZE=${OPENBLAS_L2_SIZE-<unset>} GLIBC_TUNABLES=${GLIBC_TUNABLES-<unset>} OMP_WAIT_POLICY=${OMP_WAIT_POLICY-<unset>}"
echo "   load average: $(cut -d' ' -f1-3 /proc/loadavg) (other work on the machine skews every number)"

# (b) token files: random GPT-2 tokens in llm.c's format unless --data was given.
random_tokens() {  # file, vocab
  "$PY" - "$1" "$2" <<'PYEOF' || die "could not write the token file $1"
import sys
import numpy as np
n = 1 << 20  # tokens; 13 steps need at most 13*8*256+1
header = np.zeros(256, dtype="<i4")
header[:3] = (20240520, 1, n)
toks = np.random.default_rng(1234).integers(0, int(sys.argv[2]), size=n, dtype=np.int64).astype("<u2")
with open(sys.argv[1], "wb") as f:
    f.write(header.tobytes()); f.write(toks.tobytes())
PYEOF
}
if [[ -z "$DATA" ]]; then
  DATA="$OUT/random_tokens.bin"
  random_tokens "$DATA" 50257
  echo "   data: $DATA (random tokens < 50257, llm.c format)"
else
  [[ -f "$DATA" ]] || die "--data $DATA: no such file"
  echo "   data: $DATA"
fi
if [[ " $PRESETS " == *" stories42M "* ]]; then  # its vocabulary is 32000, not GPT-2's
  DATA_32K="$OUT/random_tokens_32000.bin"
  random_tokens "$DATA_32K" 32000
  echo "   data for stories42M: $DATA_32K (random tokens < 32000, llm.c format)"
fi
data_for() { if [[ "$1" == stories42M ]]; then echo "$DATA_32K"; else echo "$DATA"; fi; }

# (e) GEMM peak, measured in this run: MFU means nothing against another
# machine's (or another day's) peak, so no measurement is an error, not a
# fallback number. --torch-only measures none and reports no MFU.
GEMM_JSON=""
if [[ $TORCH_ONLY -eq 0 ]]; then
  [[ -x "$GEMM" ]] || die "$GEMM not found: MFU needs the sgemm peak measured in this run; build it (cmake -S . -B build -DPO_BUILD_BENCH=ON && cmake --build build --target gemm_bench)"
  echo "-- gemm_bench (sgemm peak, OPENBLAS_CORETYPE/OPENBLAS_L2_SIZE unset)"
  env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE timeout "$RUN_TIMEOUT" "$GEMM" >"$OUT/gemm_bench.log" 2>&1
  rc=$?
  [[ $rc -eq 0 ]] || die "gemm_bench failed (exit $rc), so there is no sgemm peak to measure MFU against; see $OUT/gemm_bench.log"
  GEMM_JSON="$(grep -m1 '"sgemm_peak"' "$OUT/gemm_bench.log" | grep '"gflops":[0-9.]*[1-9]' || true)"
  [[ -n "$GEMM_JSON" ]] || die "no sgemm_peak line with a positive gflops in $OUT/gemm_bench.log"
  BF16_JSON="$(grep -m1 '"bf16_peak"' "$OUT/gemm_bench.log" | grep '"gflops":[0-9.]*[1-9]' || true)"
  [[ -n "$BF16_JSON" ]] || die "no bf16_peak line with a positive gflops in $OUT/gemm_bench.log"
  echo "   $GEMM_JSON"
  echo "   $BF16_JSON"
else
  echo "-- gemm_bench not run (--torch-only): no MFU"
  BF16_JSON=""
fi
echo "$GEMM_JSON" >"$OUT/gemm_peak.json"
echo "$BF16_JSON" >"$OUT/bf16_peak.json"

run_logged() {  # name, then the command; keeps the log, returns the exit status
  local name="$1"; shift
  local t0=$SECONDS
  timeout "$RUN_TIMEOUT" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  if [[ $rc -ne 0 ]]; then
    echo "   $name FAILED (exit $rc after $((SECONDS - t0)) s); last lines of $OUT/$name.log:" >&2
    tail -n 15 "$OUT/$name.log" | sed 's/^/     | /' >&2
  else
    echo "   $name done in $((SECONDS - t0)) s"
  fi
  return $rc
}

for p in $PRESETS; do
  cfg="$(config_for "$p")"
  pdata="$(data_for "$p")"
  for prec in $PRECISIONS; do
    # fp32 rows keep their names; bf16 rows end in -bf16
    sfx=""; [[ $prec == fp32 ]] || sfx="-$prec"
    echo "-- $p $prec"
    # (c) engine
    if [[ $TORCH_ONLY -eq 0 ]]; then
      rundir="$OUT/engine-$p$sfx"
      rm -rf "$rundir"
      run_logged "engine-$p$sfx" env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE \
        "$ENGINE" train -c "$cfg" --set "run.dir=$rundir" --set "data.train=$pdata" \
        --set "train.steps=$STEPS" --set "train.precision=\"$prec\""
      # The planner's whole prediction for the same run (working buffers and
      # the framework's overhead included), which its peak RSS is held to.
      "$ENGINE" plan -c "$cfg" --set "data.train=$pdata" --set "train.precision=\"$prec\"" \
        --json >"$rundir/plan.json" 2>"$OUT/plan-$p$sfx.log" ||
        echo "   plan for $p $prec FAILED; see $OUT/plan-$p$sfx.log" >&2
    fi
    # (d) PyTorch tuned (bf16: under autocast), then as given (fp32 only)
    autocast=none; [[ $prec == bf16 ]] && autocast=bf16
    run_logged "torch-tuned-$p$sfx" env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE \
      GLIBC_TUNABLES=glibc.malloc.hugetlb=1 OMP_WAIT_POLICY=PASSIVE \
      "$PY" "$ROOT/bench/torch_train.py" --preset "$p" --data "$pdata" --warmup $WARMUP \
      --steps $((STEPS - WARMUP)) --label tuned --autocast $autocast
    if [[ $AS_GIVEN -eq 1 && $prec == fp32 ]]; then
      run_logged "torch-asgiven-$p" \
        "$PY" "$ROOT/bench/torch_train.py" --preset "$p" --data "$pdata" --warmup $WARMUP \
        --steps $((STEPS - WARMUP)) --label as-given
    fi
  done
done

# (f) summary
"$PY" - "$OUT" "$WARMUP" "$TORCH_ONLY" "$PRECISIONS" $PRESETS <<'PYEOF'
import json, os, sys
out, warmup, torch_only = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
precisions, presets = sys.argv[4].split(), sys.argv[5:]
# preset: (L, C, NH, V, T, B, arch, NKV, F); Llama rows from src/model/config.cc (tied heads)
DIMS = {"bench-small": (6, 384, 6, 50257, 256, 8, "gpt2", 6, 1536),
        "gpt2-124M": (12, 768, 12, 50257, 256, 4, "gpt2", 12, 3072),
        "stories42M": (8, 512, 8, 32000, 256, 8, "llama", 8, 1376),
        "llama-124M": (12, 768, 12, 50257, 256, 4, "llama", 12, 2048)}
MFU_TARGET = {"fp32": {"gpt2-124M": 0.60, "llama-124M": 0.75}, "bf16": {"gpt2-124M": 0.50}}
RATIO_TARGET = {"fp32": {p: 1.3 for p in DIMS}, "bf16": {"bench-small": 1.5, "gpt2-124M": 1.5}}

def last_json(path, key=None):
    try:
        lines = open(path).read().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        line = line.strip()
        if line.startswith("{"):
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if key is None or key in obj:
                return obj
    return None

PEAK, PEAK_SRC = {}, {}
for prec, name in (("fp32", "gemm_peak.json"), ("bf16", "bf16_peak.json")):
    PEAK[prec], PEAK_SRC[prec] = None, "not measured (--torch-only): no MFU"
    g = last_json(os.path.join(out, name), "gflops")
    if g and g.get("gflops"):
        PEAK[prec] = float(g["gflops"])
        PEAK_SRC[prec] = "gemm_bench, %s threads%s" % (g.get("threads", "?"),
                         "" if g.get("native", True) else ", no native bf16 GEMM")
    elif not torch_only and prec in precisions:
        sys.exit("train_vs_torch.sh: error: no measured %s peak in %s" % (prec, os.path.join(out, name)))

def engine_stats(p):
    path = os.path.join(out, "engine-" + p, "metrics.jsonl")
    if not os.path.exists(path):
        return None
    steps, rss, pred, mfu = [], [], None, []
    for line in open(path):
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            m = json.loads(line)
        except ValueError:
            continue
        if "peak_rss_bytes" in m:
            rss.append(m["peak_rss_bytes"])
        if "predicted_bytes" in m:
            pred = m["predicted_bytes"]
        if "val_loss" in m or "tokens_per_s" not in m or "step" not in m:
            continue
        steps.append(m)
    steps.sort(key=lambda m: m["step"])
    timed = steps[warmup:]
    if not timed:
        return {"error": "fewer than %d training steps in %s" % (warmup + 1, path)}
    tps = len(timed) / sum(1.0 / m["tokens_per_s"] for m in timed)  # total tokens / total time
    try:  # one JSON document over many lines
        plan = json.load(open(os.path.join(out, "engine-" + p, "plan.json")))
    except (OSError, ValueError):
        plan = None
    r = {"tokens_per_s": tps, "loss": timed[-1].get("loss"), "steps_timed": len(timed),
         "peak_rss_bytes": max(rss) if rss else None, "predicted_bytes": pred,
         "planned_peak_bytes": plan.get("device_peak_bytes") if plan else None}
    if all("mfu" in m for m in timed):
        r["engine_reported_mfu"] = sum(m["mfu"] for m in timed) / len(timed)
    return r

def fmt(x, spec="%.1f"):
    return "n/a" if x is None else spec % x

def pct(x):
    return "n/a" if x is None else "%.1f%%" % (100 * x)

print()
for prec in precisions:
    print("%s GEMM peak: %s GFLOP/s (%s)" % (prec, fmt(PEAK[prec]), PEAK_SRC[prec]))
rows = []
for p, prec in [(p, prec) for p in presets for prec in precisions]:
    sfx = "" if prec == "fp32" else "-" + prec
    peak = PEAK[prec]
    L, C, NH, V, T, B, arch, NKV, FF = DIMS[p]
    if arch == "gpt2":
        n_params = V * C + T * C + L * (12 * C * C + 13 * C) + 2 * C  # wpe has seq_len rows; tied head once
    else:  # q, o: C*C; k, v: C*NKV*hs; gate, up, down: C*F; two RMSNorms; final RMSNorm; tied
        n_params = V * C + L * (2 * C * C + 2 * C * (NKV * (C // NH)) + 3 * C * FF + 2 * C) + C
    fpt = 6 * n_params + 12 * L * C * T  # attention: QK^T and AV, forward and backward
    eng = None if torch_only else engine_stats(p + sfx)
    tuned = last_json(os.path.join(out, "torch-tuned-%s%s.log" % (p, sfx)), "tokens_per_s")
    given = last_json(os.path.join(out, "torch-asgiven-%s%s.log" % (p, sfx)), "tokens_per_s")
    e_tps = eng.get("tokens_per_s") if eng else None
    t_tps = tuned["tokens_per_s"] if tuned else None
    g_tps = given["tokens_per_s"] if given else None
    mfu = lambda tps: None if tps is None or peak is None else tps * fpt / (peak * 1e9)
    # The ratio is taken against the faster PyTorch run (tuned or as given):
    # the peer a user would actually run.
    peers = [(t, name) for t, name in ((t_tps, "tuned"), (g_tps, "as given")) if t]
    best_tps, best_name = max(peers) if peers else (None, None)
    ratio = e_tps / best_tps if e_tps and best_tps else None
    rss = eng.get("peak_rss_bytes") if eng else None
    pred = eng.get("predicted_bytes") if eng else None
    planned = eng.get("planned_peak_bytes") if eng else None
    rss_err = (rss - planned) / planned if rss and planned else None
    ledger_err = (rss - pred) / pred if rss and pred else None
    print()
    print("%s %s (%s): L=%d C=%d NH=%d NKV=%d F=%d V=%d, B=%d T=%d, %d params, %.3f GFLOP/token"
          % (p, prec, arch, L, C, NH, NKV, FF, V, B, T, n_params, fpt / 1e9))
    if eng and "error" in eng:
        print("  engine: %s" % eng["error"])
    print("  %-26s %12s %8s %12s" % ("", "tokens/s", "MFU", "peak RSS"))
    print("  %-26s %12s %8s %12s" % ("engine", fmt(e_tps), pct(mfu(e_tps)),
          fmt(rss and rss / 2**20, "%.0f MiB")))
    print("  %-26s %12s %8s %12s" % ("pytorch tuned" + (", autocast" if prec == "bf16" else ""), fmt(t_tps), pct(mfu(t_tps)),
          fmt(tuned and tuned.get("peak_rss_bytes", 0) / 2**20, "%.0f MiB")))
    if given:
        print("  %-26s %12s %8s %12s" % ("pytorch as given", fmt(g_tps), pct(mfu(g_tps)),
              fmt(given.get("peak_rss_bytes", 0) / 2**20, "%.0f MiB")))
    ok = lambda c: "n/a" if c is None else ("PASS" if c else "MISS")
    rt = RATIO_TARGET[prec].get(p)
    print("  engine / torch (faster: %s): %s   (%s)" % (best_name or "none", fmt(ratio, "%.2fx"), "no target" if rt is None else
          "target >= %.1f: %s" % (rt, ok(None if ratio is None else ratio >= rt))))
    if p in MFU_TARGET[prec]:
        m, tgt = mfu(e_tps), MFU_TARGET[prec][p]
        print("  engine MFU: %s   (target >= %.0f%%: %s)" % (pct(m), 100 * tgt,
              ok(None if m is None else m >= tgt)))
    print("  engine peak RSS %s vs planned %s (pagedoptim plan): %s   (target within 20%%: %s)"
          % (fmt(rss and rss / 2**20, "%.0f MiB"), fmt(planned and planned / 2**20, "%.0f MiB"),
             fmt(None if rss_err is None else 100 * rss_err, "%+.1f%%"), ok(None if rss_err is None else abs(rss_err) <= 0.2)))
    print("  (vs metrics' predicted_bytes, model states + activations only: %s of %s)"
          % (fmt(None if ledger_err is None else 100 * ledger_err, "%+.1f%%"),
             fmt(pred and pred / 2**20, "%.0f MiB")))
    if eng and "engine_reported_mfu" in eng:
        print("  (engine's own mfu field: %.1f%%)" % (100 * eng["engine_reported_mfu"]))
    rows.append({"bench": "train_vs_torch", "preset": p, "precision": prec, "arch": arch, "batch_size": B, "seq_len": T,
                 "n_params": n_params, "flops_per_token": fpt, "peak_gflops": peak,
                 "engine_tokens_per_s": e_tps, "torch_tuned_tokens_per_s": t_tps,
                 "torch_asgiven_tokens_per_s": g_tps, "ratio_engine_vs_faster_torch": ratio,
                 "faster_torch": best_name,
                 "engine_mfu": mfu(e_tps), "torch_tuned_mfu": mfu(t_tps),
                 "engine_loss": eng.get("loss") if eng else None,
                 "torch_tuned_loss": tuned.get("loss") if tuned else None,
                 "engine_peak_rss_bytes": rss, "engine_predicted_bytes": pred,
                 "engine_planned_peak_bytes": planned, "rss_vs_planned": rss_err,
                 "rss_vs_predicted": ledger_err,
                 "torch_tuned_peak_rss_bytes": tuned.get("peak_rss_bytes") if tuned else None})
print()
with open(os.path.join(out, "results.jsonl"), "w") as f:
    for r in rows:
        line = json.dumps(r)
        print(line)
        f.write(line + "\n")
PYEOF
