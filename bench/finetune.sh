#!/usr/bin/env bash
# Fine-tuning throughput: PagedOptim's LoRA vs a PyTorch LoRA (PEFT's LoraLayer math,
# bench/torch_train.py --lora), the same model, batch, rank and targets, in the same run.
#
#   bench/finetune.sh [--preset bench-small] [--r 16] [--out DIR] [--build DIR]
#
# Builds nothing: expects build/pagedoptim. Runs, one after another, on random GPT-2 ids:
#   engine   build/pagedoptim train -c configs/<preset>.toml with lora.r = R, lora.alpha = 2R,
#            every block linear (c_attn attn.c_proj c_fc mlp.c_proj), fp32; tokens/s from
#            metrics.jsonl (steps after WARMUP; total tokens / total time)
#   torch    bench/torch_train.py --lora R (frozen base, adapters on the same four linears,
#            AdamW and clipping over the adapters), 2 threads, GLIBC_TUNABLES=glibc.malloc.hugetlb=1
#            and OMP_WAIT_POLICY=PASSIVE (train_vs_torch.sh's "tuned")
# and prints tokens/s, MFU against the sgemm peak the engine measured, peak RSS and the ratio.
# Target (issue 38): engine / torch >= 1.5. STEPS (default 8) and WARMUP (default 2) in the
# environment. The QLoRA rows of issue 38 (llama2-7b and -70b shapes on NF4 bases) wait for
# model.quant, which is not built: this script says so instead of printing a number.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY=/usr/bin/python3
PRESET=bench-small
R=16
OUT=""
BUILD="$ROOT/build"
STEPS="${STEPS:-8}"
WARMUP="${WARMUP:-2}"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --preset) PRESET="$2"; shift 2 ;;
    --r) R="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    --build) BUILD="$2"; shift 2 ;;
    -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
    *) echo "finetune.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
die() { echo "finetune.sh: error: $*" >&2; exit 1; }
ENGINE="$BUILD/pagedoptim"
[[ -x "$ENGINE" ]] || die "$ENGINE not found: build first (cmake --build build)"
[[ -x "$PY" ]] && "$PY" -c 'import torch' 2>/dev/null || die "$PY cannot import torch (apt-get install python3-torch)"
CONFIG="$ROOT/configs/$PRESET.toml"
[[ "$PRESET" == bench-small ]] && CONFIG="$ROOT/configs/bench-small.toml"
[[ -f "$CONFIG" ]] || die "no config for preset $PRESET ($CONFIG)"
OUT="${OUT:-$(mktemp -d /tmp/finetune.XXXXXX)}"
mkdir -p "$OUT"
DATA="$OUT/random.bin"
"$PY" "$ROOT/bench/random_tokens.py" "$DATA" 2000000 50257 >/dev/null || die "random tokens"

echo "== engine: LoRA r=$R on $PRESET ($STEPS steps, $WARMUP warm-up)"
rm -rf "$OUT/engine-run"
"$ENGINE" train -c "$CONFIG" --set data.train="$DATA" --set run.dir="$OUT/engine-run" \
  --set train.steps="$STEPS" --set lora.r="$R" --set lora.alpha="$((2 * R))" \
  --set 'lora.targets="c_attn attn.c_proj c_fc mlp.c_proj"' > "$OUT/engine.log" 2>&1 \
  || { tail -5 "$OUT/engine.log"; die "the engine run failed (log: $OUT/engine.log)"; }
echo "== torch: LoRA r=$R on $PRESET"
GLIBC_TUNABLES=glibc.malloc.hugetlb=1 OMP_WAIT_POLICY=PASSIVE "$PY" "$ROOT/bench/torch_train.py" \
  --preset "$PRESET" --data "$DATA" --lora "$R" --lora-alpha "$((2 * R))" \
  --steps "$((STEPS - WARMUP))" --warmup "$WARMUP" > "$OUT/torch.log" 2>&1 \
  || { tail -5 "$OUT/torch.log"; die "the PyTorch run failed (log: $OUT/torch.log)"; }

"$PY" - "$OUT" "$WARMUP" "$PRESET" "$R" <<'EOF'
import json, os, sys
out, warmup, preset, r = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
recs = [json.loads(l) for l in open(os.path.join(out, "engine-run", "metrics.jsonl"))]
timed = [m for m in recs if "tokens_per_s" in m and m.get("step", 0) > warmup]
e_tps = len(timed) / sum(1.0 / m["tokens_per_s"] for m in timed)
e_mfu = sum(m.get("mfu", 0) for m in timed) / len(timed)
e_rss = max(m.get("peak_rss_bytes", 0) for m in timed)
t = [json.loads(l) for l in open(os.path.join(out, "torch.log")) if l.startswith("{")][-1]
peak = None
for line in open(os.path.join(out, "engine.log")):
    if "sgemm peak" in line:
        peak = float(line.split("sgemm peak ")[1].split()[0])
t_mfu = t["gflops"] / peak if peak else float("nan")
ratio = e_tps / t["tokens_per_s"]
print(f"{preset} LoRA r={r}, every block linear, fp32, B={t['batch_size']} T={t['seq_len']}, "
      f"{t['adapter_params']} adapter parameters on {t['n_params']} frozen")
print(f"{'':24s}{'tokens/s':>10s}{'MFU':>9s}{'peak RSS':>12s}")
print(f"  {'engine':22s}{e_tps:10.1f}{100 * e_mfu:8.1f}%{e_rss / 2**20:9.0f} MiB")
print(f"  {'pytorch LoRA':22s}{t['tokens_per_s']:10.1f}{100 * t_mfu:8.1f}%{t['peak_rss_bytes'] / 2**20:9.0f} MiB")
print(f"  engine / pytorch: {ratio:.2f}x   (target >= 1.5: {'PASS' if ratio >= 1.5 else 'FAIL'});"
      f" sgemm peak {peak} GFLOP/s (the engine's measure, MFU's denominator)")
print("  QLoRA (llama2-7b / -70b shapes on NF4): not measured, model.quant is not built (issue 38 item 2)")
print(json.dumps({"preset": preset, "lora_r": int(r), "engine_tokens_per_s": round(e_tps, 2),
                  "torch_tokens_per_s": t["tokens_per_s"], "ratio": round(ratio, 3),
                  "engine_mfu": round(e_mfu, 4), "torch_mfu": round(t_mfu, 4),
                  "engine_peak_rss_bytes": e_rss, "torch_peak_rss_bytes": t["peak_rss_bytes"]}))
EOF
