#!/usr/bin/env bash
# Serving under load: `pagedoptim serve` with random weights of gpt2-124M's
# shape and of a Llama of the same size with grouped-query attention
# (llama-124M, 4 kv heads, GPT-2's tokenizer), driven by bench/serve_client.mjs
# (node, reading the SSE stream) at 1, 8, 32 and 64 concurrent streams with
# prompts of 32-512 tokens and outputs of 32-256, plus a shared-prefix load.
# Peers in the same run: the same model in PyTorch (bench/torch_serve.py,
# batch 1 and 32) and the physical bound of batch-1 decode, weight bytes per
# token over the read bandwidth measured by build/bench/mem_bandwidth (1 GiB,
# far past the last-level cache).
#   bench/serve_load.sh [--build DIR] [--quick] [--models gpt2,llama]
# --quick: fewer requests per load (a smoke run, not for the record).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=build; QUICK=0; MODELS=gpt2,llama
while [ $# -gt 0 ]; do
  case "$1" in
    --build) BUILD="$2"; shift 2 ;;
    --quick) QUICK=1; shift ;;
    --models) MODELS="$2"; shift 2 ;;
    *) echo "serve_load.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
done
BIN="$BUILD/pagedoptim"
[ -x "$BIN" ] || { echo "serve_load.sh: $BIN not found; run scripts/setup first" >&2; exit 1; }
OUT=$(mktemp -d /tmp/po_serve_load.XXXXXX)
SERVER=""
trap '[ -n "$SERVER" ] && kill $SERVER 2>/dev/null; rm -rf "$OUT"' EXIT
PY=/usr/bin/python3
echo "== serve_load: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) CPUs, load average $(cut -d' ' -f1-3 /proc/loadavg)"
BW=$("$BUILD/bench/mem_bandwidth" 2 1024)
echo "memory: $BW"
$PY bench/random_tokens.py "$OUT/tokens.bin" 100000

KV_BUDGET=2GiB
PORT=$((20000 + RANDOM % 20000))
for model in ${MODELS//,/ }; do
  case $model in
    gpt2) cfg=(-c configs/gpt2-124M-bench.toml); torch=(--arch gpt2 --layers 12 --embd 768 --heads 12 --kv-heads 12 --ffn 3072) ;;
    llama) cfg=(-c configs/llama-124M-bench.toml --set model.n_kv_head=4)
           torch=(--arch llama --layers 12 --embd 768 --heads 12 --kv-heads 4 --ffn 2048) ;;
    *) echo "serve_load.sh: unknown model '$model'" >&2; exit 2 ;;
  esac
  "$BIN" train "${cfg[@]}" --set model.seq_len=1024 --set data.train="$OUT/tokens.bin" --set train.steps=0 \
    --set run.dir="$OUT/$model" > "$OUT/$model.train.log" 2>&1 ||
    { echo "serve_load.sh: making the $model model failed:"; tail -5 "$OUT/$model.train.log"; exit 1; }
  "$BIN" serve "$OUT/$model" --port $PORT --threads 2 --kv-budget $KV_BUDGET --max-batch-total-tokens 1024 \
    > "$OUT/$model.serve.log" 2>&1 &
  SERVER=$!
  for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$PORT/health" > /dev/null 2>&1 && break
    kill -0 $SERVER 2>/dev/null || { echo "serve_load.sh: the server died:"; tail -5 "$OUT/$model.serve.log"; exit 1; }
    sleep 0.2
  done
  for c in 1 8 32 64; do
    n=$((c * 4)); [ $c -eq 1 ] && n=8; [ $QUICK -eq 1 ] && n=$c
    node bench/serve_client.mjs --url "http://127.0.0.1:$PORT" --concurrency $c --requests $n --seed $c \
      > "$OUT/$model.c$c.json"
  done
  node bench/serve_client.mjs --url "http://127.0.0.1:$PORT" --concurrency 32 --requests $([ $QUICK -eq 1 ] && echo 32 || echo 128) \
    --shared-prefix 256 --prompt 288:512 --out 32:64 --seed 7 > "$OUT/$model.shared.json"
  grep VmHWM "/proc/$SERVER/status" | awk '{print $2}' > "$OUT/$model.rss"  # kB
  kill -TERM $SERVER; wait $SERVER || true; SERVER=""
  $PY bench/torch_serve.py "${torch[@]}" --vocab 50257 --ctx 1024 --prompt 128 --new 64 --batch 1,32 --threads 2 \
    > "$OUT/$model.torch.json"
done

$PY - "$OUT" "$BW" "$MODELS" "$KV_BUDGET" <<'PY'
import json, sys
out, bw, models, kv_budget = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3].split(","), sys.argv[4]
def params(model):  # the served shapes (src/model/config.cc presets)
    L, C, V, T = 12, 768, 50257, 1024
    if model == "gpt2":
        return V * C + T * C + L * (12 * C * C + 13 * C) + 2 * C
    kv = 4 * 64
    return V * C + L * (C * (C + 2 * kv) + C * C + 3 * C * 2048 + 2 * C) + C
ok = True
for m in models:
    loads = {c: json.loads(open(f"{out}/{m}.c{c}.json").read()) for c in (1, 8, 32, 64)}
    shared = json.loads(open(f"{out}/{m}.shared.json").read())
    torch = {r["batch"]: r for r in map(json.loads, open(f"{out}/{m}.torch.json"))}
    rss = int(open(f"{out}/{m}.rss").read()) * 1024
    wbytes = 4 * params(m)
    bound = bw["read_gbs"] * 1e9 / wbytes
    print(f"\n{m}: {params(m) / 1e6:.1f}M parameters, {wbytes / 2**20:.0f} MiB of fp32 weights; "
          f"read bandwidth {bw['read_gbs']:.1f} GB/s -> batch-1 decode bound {bound:.1f} tokens/s")
    print(f"  {'streams':>7s} {'req':>4s} {'fail':>4s} {'TTFT p50/p99 ms':>16s} {'TPOT p50/p99 ms':>16s} "
          f"{'ITL p50/p99 ms':>15s} {'out tok/s':>9s} {'req/s':>6s} {'KV waste':>8s} {'preempt':>7s}")
    for c, r in loads.items():
        print(f"  {c:7d} {r['requests']:4d} {r['failed']:4d} {r['ttft_ms']['p50']:7.0f}/{r['ttft_ms']['p99']:<8.0f} "
              f"{r['tpot_ms']['p50']:7.1f}/{r['tpot_ms']['p99']:<8.1f} {r['itl_ms']['p50']:6.1f}/{r['itl_ms']['p99']:<8.1f} "
              f"{r['output_tokens_per_s']:9.1f} {r['requests_per_s']:6.2f} {100 * r['kv_waste']:7.2f}% {r['preemptions']:7d}")
    b1 = 1000 / loads[1]["tpot_ms"]["p50"]
    t1, t32 = torch[1]["decode_tokens_per_s"], torch[32]["decode_tokens_per_s"]
    waste = max(loads[c]["kv_waste"] for c in (8, 32, 64))
    checks = [
        (f"batch-1 decode {b1:.1f} tok/s >= 60% of the bound {bound:.1f}", b1 >= 0.6 * bound),
        (f"32 streams {loads[32]['output_tokens_per_s']:.1f} tok/s >= 10x batch-1 {loads[1]['output_tokens_per_s']:.1f}",
         loads[32]["output_tokens_per_s"] >= 10 * loads[1]["output_tokens_per_s"]),
        (f"batch 1 vs PyTorch {t1:.1f} tok/s: {b1 / t1:.2f}x (>= 2)", b1 >= 2 * t1),
        (f"32 streams vs PyTorch batch 32 {t32:.1f} tok/s: {loads[32]['output_tokens_per_s'] / t32:.2f}x (>= 2)",
         loads[32]["output_tokens_per_s"] >= 2 * t32),
        (f"KV waste {100 * waste:.2f}% < 4%", waste < 0.04),
        (f"no failed request at 64 streams ({loads[64]['failed']} failed)", loads[64]["failed"] == 0),
    ]
    print(f"  shared 256-token prefix, 32 streams: prefix-cache hit rate {100 * shared['prefix_hit_rate']:.1f}%, "
          f"{shared['output_tokens_per_s']:.1f} tok/s, TTFT p50 {shared['ttft_ms']['p50']:.0f} ms")
    print(f"  peak RSS {rss / 2**20:.0f} MiB = KV budget {kv_budget} + weights {wbytes / 2**20:.0f} MiB + "
          f"{(rss - 2 * 2**30 - wbytes) / 2**20:.0f} MiB (activations for 1024 rows, logits, the runtime)")
    for text, good in checks:
        print(f"  {'PASS' if good else 'FAIL'}: {text}")
        ok = ok and good
print("\nall targets met" if ok else "\nsome targets not met")
PY
