#!/usr/bin/env bash
# Fine-tuning throughput: PagedOptim's LoRA vs a PyTorch LoRA (PEFT's LoraLayer math,
# bench/torch_train.py --lora), the same model, batch, rank and targets, in the same run.
#
#   bench/finetune.sh [--preset bench-small] [--r 16] [--out DIR] [--build DIR]
#   bench/finetune.sh --qlora [--qlora-preset llama2-7b] [--qlora-tokens 256] [--out DIR] [--build DIR]
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
# environment.
#
# --qlora: QLoRA on a big shape with random weights (issue 38's 7B row): model.quant = nf4,
# lora r = R on every block linear, 1 sequence of --qlora-tokens, bf16, activation
# checkpointing, 2 threads, QSTEPS (default 2) steps of which the last is timed. Prints the
# peak RSS of the whole process (GNU time's maximum resident set: start-up, quantization and
# the steps), the seconds of the timed step and of the whole run, the NF4 base's bytes, and
# beside them what the planner predicts for a full fine-tune of the same shape and batch
# (pagedoptim plan). Target: peak RSS <= 8 GiB.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY=/usr/bin/python3
PRESET=bench-small
R=16
OUT=""
BUILD="$ROOT/build"
STEPS="${STEPS:-8}"
WARMUP="${WARMUP:-2}"
QLORA=0
QPRESET=llama2-7b
QTOKENS=256
QSTEPS="${QSTEPS:-2}"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --preset) PRESET="$2"; shift 2 ;;
    --r) R="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    --build) BUILD="$2"; shift 2 ;;
    --qlora) QLORA=1; shift ;;
    --qlora-preset) QPRESET="$2"; shift 2 ;;
    --qlora-tokens) QTOKENS="$2"; shift 2 ;;
    -h|--help) sed -n '2,28p' "$0"; exit 0 ;;
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

if [[ "$QLORA" == 1 ]]; then
  [[ -x /usr/bin/time ]] || die "/usr/bin/time not found (apt-get install time)"
  QDATA="$OUT/random32k.bin"
  "$PY" "$ROOT/bench/random_tokens.py" "$QDATA" 200000 32000 >/dev/null || die "random tokens"
  QCFG="$OUT/qlora.toml"
  cat > "$QCFG" <<TOML
[model]
preset = "$QPRESET"
seq_len = $QTOKENS
quant = "nf4"
activation_checkpointing = true
[lora]
r = $R
alpha = $((2 * R))
targets = "q_proj k_proj v_proj o_proj gate_proj up_proj down_proj"
[train]
batch_size = 1
micro_batch_size = 1
steps = $QSTEPS
precision = "bf16"
threads = 2
eval_interval = 0
checkpoint_interval = 0
warmup_steps = 0
[data]
train = "$QDATA"
[run]
dir = "$OUT/qlora-run"
TOML
  echo "== engine: QLoRA (nf4) r=$R on $QPRESET, 1 x $QTOKENS tokens, bf16, $QSTEPS steps"
  rm -rf "$OUT/qlora-run"
  /usr/bin/time -v "$ENGINE" train -c "$QCFG" > "$OUT/qlora.log" 2>&1 \
    || { tail -20 "$OUT/qlora.log"; die "the QLoRA run failed (log: $OUT/qlora.log)"; }
  FULLCFG="$OUT/full.toml"
  grep -v -e '^quant' -e '^r =' -e '^alpha' -e '^targets' "$QCFG" > "$FULLCFG"
  "$ENGINE" plan -c "$FULLCFG" --json > "$OUT/plan-full.json" 2> "$OUT/plan-full.log" \
    || { tail -5 "$OUT/plan-full.log"; die "pagedoptim plan failed (log: $OUT/plan-full.log)"; }
  "$PY" "$ROOT/bench/finetune_qlora_report.py" "$OUT" "$QPRESET" "$QTOKENS" "$R"
  exit $?
fi

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
print("  QLoRA on a llama2-7b shape: bench/finetune.sh --qlora")
print(json.dumps({"preset": preset, "lora_r": int(r), "engine_tokens_per_s": round(e_tps, 2),
                  "torch_tokens_per_s": t["tokens_per_s"], "ratio": round(ratio, 3),
                  "engine_mfu": round(e_mfu, 4), "torch_mfu": round(t_mfu, 4),
                  "engine_peak_rss_bytes": e_rss, "torch_peak_rss_bytes": t["peak_rss_bytes"]}))
EOF
