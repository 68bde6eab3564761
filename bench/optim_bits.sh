#!/usr/bin/env bash
# The AdamW step at 32, 8 and 4 bits of state (optim.state_bits), in RAM, in
# one run: ours (bench/backend/optim_bits_bench.cc, GB/s against a STREAM
# triad measured in the same process) and PyTorch's on the same element
# count and threads (bench/torch_optim_bits.py: torch.optim.AdamW at 32
# bits, bitsandbytes' and torchao's blockwise algorithms in vectorised torch
# at 8 and 4). Prints each width's step time, elements per second, the ratio
# ours / torch, and ours against the memory bandwidth (target >= 0.8).
# With --nvme DIR (a directory on the disk to page to), then gpt2-124M
# (configs/gpt2-124M-bench.toml, fp32, 1 process) at 32 and at 8 bits, each
# in RAM and with Adam's state paged to NVMe (4 MiB pages, a compute budget of
# the engine's named minimum + 8 pages): the page bytes moved per step at 8
# bits against 32 (target <= 0.5) and each width's paged step against its
# in-RAM step (targets: 8 bits <= 1.05, 32 bits <= 1.1).
#   bench/optim_bits.sh [--build DIR] [--threads N] [--millions M] [--nvme DIR [--steps N]]
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=build; THREADS=2; MILLIONS=16; NVME=""; STEPS=6
while [ $# -gt 0 ]; do
  case "$1" in
    --build) BUILD="$2"; shift 2 ;;
    --threads) THREADS="$2"; shift 2 ;;
    --millions) MILLIONS="$2"; shift 2 ;;
    --nvme) NVME="$2"; shift 2 ;;
    --steps) STEPS="$2"; shift 2 ;;
    *) echo "optim_bits.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
done
BIN="$BUILD/bench/optim_bits_bench"
[ -x "$BIN" ] || { echo "optim_bits.sh: $BIN not found; run scripts/setup first" >&2; exit 1; }
OURS=$("$BIN" "$THREADS" "$MILLIONS")
TORCH=$(/usr/bin/python3 bench/torch_optim_bits.py "$THREADS" "$MILLIONS")
echo "$OURS" | grep -v '^{'
echo "cpu: $(lscpu | sed -n 's/^Model name:[[:space:]]*//p' | head -1), $THREADS threads, ${MILLIONS}M elements"
/usr/bin/python3 - "$OURS" "$TORCH" <<'PY'
import json, sys
ours = {r["bits"]: r for r in map(json.loads, (l for l in sys.argv[1].splitlines() if l.startswith("{")))}
torch = {r["bits"]: r for r in map(json.loads, (l for l in sys.argv[2].splitlines() if l.startswith("{")))}
print(f"{'bits':>4} {'ours ms':>9} {'torch ms':>9} {'ours/torch speed':>17} {'ours GB/s':>10} {'of triad':>9}")
for b in (32, 8, 4):
    o, t = ours[b], torch[b]
    print(f"{b:>4} {o['ms']:>9.2f} {t['ms']:>9.2f} {t['ms'] / o['ms']:>16.2f}x {o['gbs']:>10.1f} "
          f"{o['gbs'] / o['triad_gbs']:>8.0%}")
print(f"torch {torch[32]['torch']}; memory bandwidth (triad) {ours[32]['triad_gbs']:.1f} GB/s")
PY

[ -n "$NVME" ] || exit 0
ENGINE="$BUILD/pagedoptim"
OUT=$(mktemp -d "$NVME/po_optim_bits.XXXXXX")
trap 'rm -rf "$OUT"' EXIT
/usr/bin/python3 bench/random_tokens.py "$OUT/tokens.bin" 500000
COMMON=(train -c configs/gpt2-124M-bench.toml --set data.train="$OUT/tokens.bin" --set train.steps="$STEPS"
        --set train.threads="$THREADS" --set train.checkpoint_interval=0)
PAGED=(--set memory.nvme_dir="$OUT/swap" --set memory.page_size=4MiB)
for bits in 32 8; do
  B=(--set optim.state_bits=$bits)
  "$ENGINE" "${COMMON[@]}" "${B[@]}" --set run.dir="$OUT/ram$bits" > "$OUT/ram$bits.log" 2>&1 \
    || { echo "in-RAM run at $bits bits failed:"; tail -5 "$OUT/ram$bits.log"; exit 1; }
  MIN=$("$ENGINE" "${COMMON[@]}" "${B[@]}" "${PAGED[@]}" --set memory.compute_budget=1 \
        --set run.dir="$OUT/probe$bits" 2>&1 | sed -n 's/.*at least \([0-9]*\) bytes.*/\1/p' | head -1 || true)
  [ -n "$MIN" ] || { echo "no minimum compute budget named at $bits bits"; exit 1; }
  "$ENGINE" "${COMMON[@]}" "${B[@]}" "${PAGED[@]}" --set memory.compute_budget=$((MIN + 8 * 4194304)) \
    --set run.dir="$OUT/paged$bits" > "$OUT/paged$bits.log" 2>&1 \
    || { echo "paged run at $bits bits failed:"; tail -5 "$OUT/paged$bits.log"; exit 1; }
  grep -A4 "paged optimizer state" "$OUT/paged$bits.log" | sed 's/^/  /'
done
/usr/bin/python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
def recs(run, key):  # the first step pays one-time costs
    return [json.loads(l) for l in open(f"{out}/{run}/metrics.jsonl") if f'"{key}"' in l][1:]
ms = lambda run: sum(r["step_ms"] for r in recs(run, "loss")) / len(recs(run, "loss"))
GB, res = 1e9, {}
for bits in (32, 8):
    pg = [r["paging"] for r in recs(f"paged{bits}", "paging")]
    moved = sum(p["nvme_read_bytes"] + p["nvme_written_bytes"] for p in pg) / len(pg)
    res[bits] = {"ram_ms": ms(f"ram{bits}"), "paged_ms": ms(f"paged{bits}"), "moved": moved}
print("gpt2-124M, fp32, Adam state on NVMe (4 MiB pages, budget = minimum + 8 pages):")
print(f"{'bits':>4} {'in RAM ms':>10} {'paged ms':>9} {'paged/RAM':>10} {'NVMe GB/step':>13}")
for bits, target in ((32, 1.10), (8, 1.05)):
    r = res[bits]
    x = r["paged_ms"] / r["ram_ms"]
    print(f"{bits:>4} {r['ram_ms']:>10.0f} {r['paged_ms']:>9.0f} {x:>9.3f}x {r['moved']/GB:>13.3f}"
          f"   (target <= {target}: {'PASS' if x <= target else 'FAIL'})")
ratio = res[8]["moved"] / res[32]["moved"]
print(f"page bytes per step, 8 bits / 32 bits: {ratio:.3f} (target <= 0.5: {'PASS' if ratio <= 0.5 else 'FAIL'})")
print(json.dumps({"bench": "optim_bits_nvme", **{str(b): r for b, r in res.items()}, "bytes_ratio": ratio}))
PY
